"""The side-by-side benchmark suite (``python -m hf_paged bench``): one process, one model, the same
requests for every system; ratios are printed and saved as JSON, with plots when matplotlib is
installed (``pip install "hf_paged[bench]"``; from a checkout ``pip install -e ".[bench]"``). A section
whose optional dependency is missing (the serving section needs httpx) is skipped, and a section that
fails is recorded as failed, with the reason, in bench.json beside the others' results."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from hf_paged.bench import (SUITE_SECTIONS, generate_speed, memory, prefix_generate, serving, systems,
                             tensor_parallel, workloads)
from hf_paged.bench.optional import INSTALL, missing

# The sections that need an optional dependency (the ``bench`` extra), checked before anything runs.
SECTION_NEEDS = {"serving": ("httpx",)}


def _ratio(a: dict, b: dict, key: str = "tokens_per_s") -> float:
    return a[key] / b[key] if b.get(key) else float("nan")


def _mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


def run(model, *, num_requests: int = 64, scale: float = 0.25, batch_size: int = 8,
        rates=(1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
        out_dir: str | Path = "benchmarks/out", block_size: int = 16, num_blocks: int = 4096,
        max_num_batched_tokens: int = 512, quick: bool = False, repeats: int = 5, log=print,
        generate_new_tokens: int = generate_speed.NEW_TOKENS, skip: tuple[str, ...] = ()) -> dict:
    """The whole suite; returns (and writes) the results. ``skip``: sections of
    :data:`hf_paged.bench.SUITE_SECTIONS` not to run.

    The headline offline comparison runs every system ``repeats`` times, interleaved (one round of
    all systems, then the next), and reports each system's median run: on a shared machine the
    speed drifts over minutes, and interleaving exposes every system to the same drift.
    """
    unknown = sorted(set(skip) - set(SUITE_SECTIONS))
    if unknown:
        raise ValueError(f"unknown sections to skip {unknown}: the sections are {list(SUITE_SECTIONS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    skipped = {name: f"{' and '.join(gone)} not installed: {INSTALL}"
               for name, needs in SECTION_NEEDS.items() if (gone := missing(*needs))}
    skipped.update((name, "not asked for (skip)") for name in skip)
    for name, why in skipped.items():
        log(f"the {name} section will be skipped: {why}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    engine_kwargs = dict(block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=256)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {torch.get_num_threads()} "
                     f"torch threads", "versions": _versions(), "settings": {
                         "num_requests": num_requests, "scale": scale, "batch_size": batch_size,
                         "block_size": block_size, "num_blocks": num_blocks,
                         "max_num_batched_tokens": max_num_batched_tokens, "repeats": repeats}}

    share = workloads.dataset("sharegpt", num_requests, scale=scale, vocab=vocab)
    log(f"ShareGPT-like offline: {num_requests} requests, mean prompt {share.mean_prompt:.1f}, "
        f"mean output {share.mean_output:.1f} tokens")

    def systems_on(wl):
        """The four systems, each a thunk running ``wl`` (transformers CB in real time if it has arrivals)."""
        return (("padded_generate", lambda: systems.batched_generate(model, wl, batch_size, paged=False)),
                ("paged_generate", lambda: systems.batched_generate(model, wl, batch_size, paged=True)),
                ("transformers_cb", lambda: systems.transformers_cb(
                    model, wl, num_blocks=num_blocks // 4, max_batch_tokens=max_num_batched_tokens)),
                ("engine", lambda: systems.engine_run(model, wl, **engine_kwargs)))

    # Warm-up, untimed: the first run in a process pays one-time costs (allocator, thread pools).
    for name, fn in systems_on(workloads.dataset("sharegpt", min(8, num_requests), scale=scale, vocab=vocab,
                                                      seed=1)):
        try:
            fn()
        except Exception:
            pass  # reported by the timed rounds
    runs: dict[str, list[systems.RunResult]] = {}
    for round_ in range(max(1, repeats)):
        for name, fn in systems_on(share):
            if round_ and name not in runs:
                continue  # failed in the first round
            try:
                runs.setdefault(name, []).append(fn())
                log(f"  round {round_ + 1}: {name:<16} {runs[name][-1].summary(share)['tokens_per_s']:8.1f} tok/s")
            except Exception as err:  # one system failing must not hide the others
                runs.pop(name, None)
                log(f"  {name:<16} failed: {type(err).__name__}: {err}")
    offline = {name: sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2] for name, rs in runs.items()}  # median
    summaries = {k: {**v.summary(share), "tokens_per_s_all_runs": [r.summary(share)["tokens_per_s"] for r in runs[k]]}
                 for k, v in offline.items()}
    base = summaries.get("padded_generate")
    results["sharegpt_offline"] = {
        "workload": {"mean_prompt": share.mean_prompt, "mean_output": share.mean_output},
        "systems": summaries,
        "throughput_vs_padded_generate": {k: _ratio(v, base) for k, v in summaries.items()} if base else {},
        "engine_vs_transformers_cb": _ratio(summaries["engine"], summaries["transformers_cb"])
        if {"engine", "transformers_cb"} <= summaries.keys() else None,
        "engine_vs_padded_generate_per_round": [
            e / p for e, p in zip(summaries["engine"]["tokens_per_s_all_runs"],
                                  summaries["padded_generate"]["tokens_per_s_all_runs"])]
        if {"engine", "padded_generate"} <= summaries.keys() else [],
        "greedy_mismatches_vs_padded_generate": {k: _mismatches(v.tokens, offline["padded_generate"].tokens)
                                                 for k, v in offline.items() if "padded_generate" in offline},
    }

    # The padded baseline at other batch sizes (one round each): is batch_size its best setting?
    if not quick and "engine" in summaries:
        sweep = {}
        for size in (4, 8, 16, 32, 64):
            try:
                sweep[size] = systems.batched_generate(model, share, size, paged=False).summary(share)["tokens_per_s"]
            except Exception as err:  # e.g. out of memory at a large batch
                log(f"  padded generate, batch {size}: failed: {type(err).__name__}: {err}")
        if sweep:
            best = max(sweep, key=sweep.get)
            results["sharegpt_offline"]["padded_generate_batch_sweep"] = {
                "tokens_per_s": sweep, "best_batch_size": best,
                "engine_vs_best_padded_generate": summaries["engine"]["tokens_per_s"] / sweep[best]}
            log(f"  padded generate by batch size (tok/s): {sweep}; engine vs the best ({best}): "
                f"{summaries['engine']['tokens_per_s'] / sweep[best]:.2f}x")

    alpaca = workloads.dataset("alpaca", num_requests, scale=1.0, vocab=vocab)
    results["alpaca_offline"] = {k: v.summary(alpaca) for k, v in {
        "padded_generate": systems.batched_generate(model, alpaca, batch_size, paged=False),
        "engine": systems.engine_run(model, alpaca, **engine_kwargs)}.items()}

    # Parallel sampling and beam search (the paper's Figure 14 workloads), engine vs padded generate.
    variants_base = workloads.dataset("alpaca", 2 if quick else 32, scale=1.0, vocab=vocab, seed=2)
    results["decoding_variants"] = []
    for label, wl in ([(f"parallel sampling n={n}", workloads.with_sampling(variants_base, n=n)) for n in (2, 4, 6)]
                      + [(f"beam search width {k}", workloads.with_sampling(variants_base, num_beams=k))
                         for k in (2, 4, 6)]):
        padded = systems.batched_generate(model, wl, batch_size, paged=False).summary(wl)
        engine = systems.engine_run(model, wl, **engine_kwargs).summary(wl)
        ratio = _ratio(engine, padded, "requests_per_s")
        results["decoding_variants"].append({"decoding": label, "padded_generate": padded, "engine": engine,
                                             "engine_vs_padded_generate": ratio})
        log(f"  {label}: engine {engine['requests_per_s']:.2f} req/s vs padded generate "
            f"{padded['requests_per_s']:.2f} req/s ({ratio:.2f}x)")

    results["online"] = []
    for rate in () if quick else rates:
        online = workloads.poisson(share, rate)
        row = {"rate": rate}
        for name, fn in systems_on(online):
            if name == "paged_generate":
                continue  # the flag's latency is padded generate's batching plus a slower step: not swept
            try:
                row[name] = fn().summary(online)
            except Exception as err:
                log(f"  Poisson {rate:g} req/s: {name} failed: {type(err).__name__}: {err}")
        log(f"  Poisson {rate:g} req/s: normalized latency (s/token) " + ", ".join(
            f"{name} {r['normalized_latency_s_per_token']:.3f}" for name, r in row.items()
            if isinstance(r, dict) and "normalized_latency_s_per_token" in r))
        results["online"].append(row)
    results["sustainable_rate"] = sustainable_rates(results["online"])
    if results["online"]:
        log(f"  highest rate with normalized latency within 2x of the lowest rate's: {results['sustainable_rate']}")

    prefix_rows = []
    for shots in (1, 5):
        wl = workloads.shared_prefix(num_requests // 2, shots, vocab=vocab)
        on = systems.engine_run(model, wl, **engine_kwargs).summary(wl)
        off = systems.engine_run(model, wl, **engine_kwargs, enable_prefix_caching=False).summary(wl)
        prefix_rows.append({"shots": shots, "prefix_caching": on, "no_prefix_caching": off,
                            "speedup": _ratio(on, off), "computed_prompt_tokens_saved":
                            off["computed_prompt_tokens"] - on["computed_prompt_tokens"]})
    results["shared_prefix"] = prefix_rows

    # The sections below each stand alone: one that is skipped or fails is recorded so, with the reason.
    not_run = results["sections_not_run"] = {}

    def section(name: str, title: str, fn) -> None:
        if name in skipped:
            results[name] = not_run[name] = {"skipped": skipped[name]}
            log(f"{title}: skipped ({skipped[name]})")
            return
        log(f"{title}:")
        try:
            results[name] = fn()
        except Exception as err:  # noqa: BLE001 - one section failing must not lose the others' results
            results[name] = not_run[name] = {"failed": f"{type(err).__name__}: {err}"}
            log(f"  {name} failed: {type(err).__name__}: {err}")

    # generate() with the flag against stock generate(), on generate_speed's own model (see its docstring).
    section("generate_flag_vs_stock", "generate() with the flag vs stock generate() (stock time / flag time)",
            lambda: generate_speed.run(rounds=max(1, repeats), log=log, new_tokens=generate_new_tokens,
                                       cases=generate_speed.cases(0.1 if quick else 1.0)))

    # Prefix caching inside generate(): few-shot and multi-turn, against stock and the flag without it.
    section("prefix_generate", "prefix caching in generate()",
            lambda: prefix_generate.run(questions=8 if quick else 128, prefix_len=100 if quick else 1000,
                                        turns=2 if quick else 8, log=log))

    # Serving: the HTTP server against the in-process engine (32 clients); tensor parallelism: 2 ranks vs 1 process.
    section("serving", "HTTP server vs in-process engine, 32 concurrent clients",
            lambda: serving.run(num_requests=16 if quick else 256, rounds=1 if quick else 3, log=log))
    section("tensor_parallel", "tensor parallelism, 2 ranks vs 1 process",
            lambda: tensor_parallel.run(requests=4 if quick else 48, log=log))

    # Utilization depends on lengths only: computed at the paper's own length scale (ShareGPT-like,
    # means 161 / 338 tokens, reservation to a 2048-token maximum as the paper's OPT-13B), 1000 requests.
    paper_scale = workloads.dataset("sharegpt", 1000, scale=1.0, vocab=vocab, max_len=2048, seed=1)
    results["kv_utilization"] = memory.kv_utilization(paper_scale, max_len=2048)
    results["kv_utilization_at_benchmark_scale"] = memory.kv_utilization(share, max_len=2048)
    small = workloads.dataset("alpaca", 4 if quick else 16, scale=1.0, vocab=vocab)
    results["sharing_savings"] = {
        **{f"parallel sampling n={n}": memory.sharing_savings(model, workloads.with_sampling(small, n=n))
           for n in (2, 4, 6)},
        **{f"beam search width {k}": memory.sharing_savings(model, workloads.with_sampling(small, num_beams=k))
           for k in (2, 4, 6)},
    }
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    _plots(results, out_dir, log)
    log(report(results))
    return results


def sustainable_rates(online: list[dict], factor: float = 2.0) -> dict:
    """Per system, the highest swept rate whose normalized latency stays within ``factor`` times its
    latency at the lowest rate (where the curve of the paper's Figure 12 has not yet turned up)."""
    out = {}
    for name in ("padded_generate", "transformers_cb", "engine"):
        rows = sorted((r for r in online if "normalized_latency_s_per_token" in r.get(name, {})),
                      key=lambda r: r["rate"])
        if not rows:
            continue
        base = rows[0][name]["normalized_latency_s_per_token"]
        out[name] = rows[0]["rate"]
        for r in rows[1:]:
            if r[name]["normalized_latency_s_per_token"] > factor * base:
                break
            out[name] = r["rate"]
    return out


def _versions() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def report(results: dict) -> str:
    """Markdown tables of the headline numbers."""
    lines = ["| system | tok/s | req/s | vs padded generate | peak KV | max running |", "| --- | --- | --- | --- | --- | --- |"]
    off = results["sharegpt_offline"]
    for name, s in off["systems"].items():
        kv = f"{s['peak_kv_bytes'] / 2**20:.1f} MiB" if s.get("peak_kv_bytes") else "-"
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {s['requests_per_s']:.2f} | "
                     f"{off['throughput_vs_padded_generate'].get(name, float('nan')):.2f}x | {kv} | {'-' if s['max_running'] is None else s['max_running']} |")
    lines.append(f"\nengine vs transformers continuous batching: {off['engine_vs_transformers_cb']}")
    lines.append(f"engine vs padded generate, per round: {off.get('engine_vs_padded_generate_per_round')}")
    if "padded_generate_batch_sweep" in off:
        lines.append(f"padded generate by batch size: {off['padded_generate_batch_sweep']}")
    lines.append(f"greedy mismatches vs padded generate: {off['greedy_mismatches_vs_padded_generate']}")
    lines += ["", "| decoding (Alpaca-like) | engine req/s | padded generate req/s | ratio |", "| --- | --- | --- | --- |"]
    lines += [f"| {v['decoding']} | {v['engine']['requests_per_s']:.2f} | {v['padded_generate']['requests_per_s']:.2f} | "
              f"{v['engine_vs_padded_generate']:.2f}x |" for v in results.get("decoding_variants", [])]
    lines += ["", "| generate() case | stock time / flag time (median) | sequences identical |", "| --- | --- | --- |"]
    lines += [f"| {case} | {r['median']:.2f}x | {r['sequences_identical']} |"
              for case, r in _ran(results, "generate_flag_vs_stock").items()]
    few = _ran(results, "prefix_generate").get("few_shot")
    if few:
        lines += ["", f"| few-shot generate(), {few['questions']} questions, {few['prefix_tokens']}-token prefix | wall s | "
                  "vs stock | tokens computed | prefix not recomputed |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {name} | {r['wall_s']:.2f} | {r['speedup_vs_stock']:.2f}x | {r['tokens_computed']} | "
                  f"{r['prefix_tokens_not_recomputed']:.1%} |" for name, r in few["systems"].items()]
    if _ran(results, "serving"):
        lines += ["", serving.report(results["serving"])]
    if _ran(results, "tensor_parallel"):
        tp = results["tensor_parallel"]
        lines += ["", f"tensor parallelism: {tp['ranks']} ranks {tp['tensor_parallel']['tokens_per_s']:.1f} tok/s, "
                      f"1 process {tp['single_process']['tokens_per_s']:.1f} tok/s ({tp['tp_over_single']:.2f}x), "
                      f"identical outputs: {tp['identical_outputs']}"]
    lines += ["", "| KV reservation | utilization |", "| --- | --- |"]
    lines += [f"| {k} | {v:.1%} |" for k, v in results["kv_utilization"].items()]
    lines += ["", "| sharing | blocks saved |", "| --- | --- |"]
    lines += [f"| {k} | {v['saving']:.1%} |" for k, v in results["sharing_savings"].items()]
    lines += ["", "| shared prefix | speedup with prefix caching | prompt tokens not recomputed |", "| --- | --- | --- |"]
    lines += [f"| {r['shots']}-shot | {r['speedup']:.2f}x | {r['computed_prompt_tokens_saved']} |"
              for r in results["shared_prefix"]]
    lines += [f"\n{name}: {next(iter(why))} ({next(iter(why.values()))})"
              for name, why in results.get("sections_not_run", {}).items()]
    return "\n".join(lines)


def _ran(results: dict, name: str) -> dict:
    """A section's results; empty where it did not run (skipped or failed)."""
    return {} if name in results.get("sections_not_run", {}) else results.get(name) or {}


def _plots(results: dict, out_dir: Path, log) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"(matplotlib not installed: no plots; {INSTALL})")
        return
    if results["online"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name in ("padded_generate", "transformers_cb", "engine"):
            rows = [r for r in results["online"] if "normalized_latency_s_per_token" in r.get(name, {})]
            if rows:
                ax.plot([r["rate"] for r in rows], [r[name]["normalized_latency_s_per_token"] for r in rows], "o-",
                        label=name)
        ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)", title="ShareGPT-like",
               xscale="log", yscale="log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "latency_vs_rate.png", dpi=120)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
    util = results["kv_utilization"]
    a1.barh(list(util), [v * 100 for v in util.values()])
    a1.set(xlabel="KV slots holding real tokens (%)", title="KV utilization (paper Fig. 2)")
    share = results["sharing_savings"]
    a2.bar(list(share), [v["saving"] * 100 for v in share.values()])
    a2.set(ylabel="blocks saved (%)", title="Sharing savings (paper Fig. 15)")
    a2.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(out_dir / "memory.png", dpi=120)
    plt.close("all")
