"""``hf-paged serve`` against llama.cpp's server on the same CPU, model and requests.

    python benchmarks/vs_llamacpp.py --llama-cpp DIR [--concurrency 1,4,32] [--rounds 2] [--out FILE]

DIR is a llama.cpp source tree with its server built (``cmake -B build -DLLAMA_CURL=OFF &&
cmake --build build --target llama-server``): ``DIR/build/bin/llama-server`` serves, and
``DIR/convert_hf_to_gguf.py`` with ``DIR/gguf-py`` converts. The tree vendored in the
``llama-cpp-python`` source distribution (``pip download --no-binary :all: llama-cpp-python``,
``vendor/llama.cpp``) is one; no network is needed after that.

The model is issue 22's (a random-init 19M-parameter Llama, float32, built from code), converted to
GGUF in float32 with llama.cpp's own converter; its word vocabulary ("▁w123": one word per id) goes
in as a SentencePiece-style vocabulary, so llama.cpp's text spells every generated id. Both servers
get the same requests from the same ``openai``-client load generator (``hf_paged/bench/loadgen.py``:
prompts as token ids, greedy, EOS ignored, streamed), at each ``--concurrency`` (closed loop, 4
requests per client, 256-token prompts, 256 new tokens), rounds interleaved, each server fresh per
run. llama.cpp runs with one slot per client (``-np``, 1,024 tokens of context each), float32 K/V
(``-ctk f32 -ctv f32``; its default is float16) and ``--threads`` threads; hf_paged with its
defaults. Its OpenAI stream carries no token ids: the load generator reads them from the text, and
opens a connection per request (reused connections to it failed at 32 clients, every run tried).

Reported per concurrency: output tok/s (median of rounds), the ratio, p50/p99 latency and TTFT,
each server's CPU time per token, and greedy agreement (identical outputs, and the share of tokens
before each output's first difference: both are float32 but sum in different orders, so long greedy
runs may part).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/ (its kernels.py)

from hf_paged.bench import vs_vllm  # noqa: E402
from hf_paged.bench.local_server import LocalServer, free_port  # noqa: E402
from hf_paged.bench.vllm_worker import versions  # noqa: E402

TOKEN_PATTERN = r"w(\d+)"  # the benchmark vocabulary's spelling of token ids ("▁w123" -> " w123")
PROMPT_TOKENS = NEW_TOKENS = 256
REQUESTS_PER_CLIENT = 4
SLOT_CONTEXT = 1024  # llama.cpp's context per slot (-c is split among the -np slots)

# Runs in a child process (llama.cpp's converter imports its own packages from DIR): the converter
# for the Llama architecture, with the vocabulary written from the checkpoint's word list.
_CONVERT = r'''
import sys
from pathlib import Path
tree, model_dir, out = sys.argv[1:4]
sys.path[:0] = [tree, str(Path(tree) / "gguf-py")]
import gguf
import convert_hf_to_gguf
from conversion import llama

def set_vocab(self):
    n = self.hparams["vocab_size"]
    special = {0: "<pad>", 1: "<s>", 2: "</s>"}
    writer = self.gguf_writer
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([special.get(i, "\u2581w%d" % i).encode() for i in range(n)])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)])
    writer.add_bos_token_id(1); writer.add_eos_token_id(2); writer.add_pad_token_id(0)
    writer.add_add_bos_token(False); writer.add_add_eos_token(False)

llama.LlamaModel.set_vocab = set_vocab
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", "f32"]
convert_hf_to_gguf.main()
'''


def requests(count: int, prompt_tokens: int, new_tokens: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(prompt_tokens)], "max_tokens": new_tokens}
            for _ in range(count)]


def convert(tree: Path, model_dir: Path, out: Path) -> None:
    """``model_dir`` (the benchmark checkpoint) as a float32 GGUF at ``out``, by llama.cpp's converter."""
    done = subprocess.run([sys.executable, "-c", _CONVERT, str(tree), str(model_dir), str(out)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"llama.cpp's converter failed: {done.stderr.strip()[-2000:]}")


def llama_server_command(tree: Path, gguf: Path, clients: int, threads: int, port: int) -> list[str]:
    return [str(tree / "build" / "bin" / "llama-server"), "-m", str(gguf), "-c", str(clients * SLOT_CONTEXT),
            "-np", str(clients), "-t", str(threads), "-ctk", "f32", "-ctv", "f32", "--host", "127.0.0.1",
            "--port", str(port)]


def hf_server_command(model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "hf_paged", "serve", "--model", str(model_dir), "--served-model-name", "bench",
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-waiting", "100000"]


def run_one(system: str, clients: int, ctx: dict, opts: argparse.Namespace) -> dict:
    """One fresh server of ``system`` under the closed loop of ``clients`` clients."""
    port = free_port()
    if system == "llama.cpp":
        cmd = llama_server_command(opts.llama_cpp, ctx["gguf"], clients, opts.threads, port)
    else:
        cmd = hf_server_command(ctx["model_dir"], port)
    log = ctx["work"] / f"{system}-{clients}-{next(ctx['ids'])}"
    with LocalServer(cmd, port, name=system, log_path=log.with_suffix(".log")) as server:
        spec = {"url": server.url, "server_pid": server.proc.pid, "requests": ctx["requests"][clients],
                "warmup": ctx["warmup"][clients], "concurrency": clients, "sampling": {"temperature": 0.0},
                "token_pattern": TOKEN_PATTERN, "keepalive": system != "llama.cpp"}
        Path(log.with_suffix(".spec.json")).write_text(json.dumps(spec))
        result_path = log.with_suffix(".result.json")
        subprocess.run([sys.executable, str(vs_vllm.LOADGEN), str(log.with_suffix(".spec.json")), str(result_path)],
                       check=True, timeout=3600)
        result = json.loads(result_path.read_text())
    generated = sum(map(len, result["tokens"]))
    return {"tokens_per_s": generated / result["wall_s"], "generated_tokens": generated,
            **vs_vllm.percentiles("latency_s", result["latency_s"]), **vs_vllm.percentiles("ttft_s", result["ttft_s"]),
            "server_cpu_ms_per_token": 1e3 * result["server_cpu_s"] / generated,
            "other_load_cores": result["other_load_cores"], "tokens": result["tokens"]}


def llama_cpp_version(tree: Path) -> str:
    done = subprocess.run([str(tree / "build" / "bin" / "llama-server"), "--version"], capture_output=True,
                          text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith(("version", "built"))]
    return "; ".join(lines) if done.returncode == 0 and lines else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp tree with build/bin/llama-server")
    parser.add_argument("--concurrency", default="1,4,32", help="comma-separated client counts")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/vs_llamacpp.json"))
    opts = parser.parse_args(argv)
    server = opts.llama_cpp / "build" / "bin" / "llama-server"
    if not server.exists() or not (opts.llama_cpp / "convert_hf_to_gguf.py").exists():
        print(f"{opts.llama_cpp} has no build/bin/llama-server or convert_hf_to_gguf.py; see this script's "
              f"docstring (python {__file__} --help) for how to get and build one", file=sys.stderr)
        return 2
    clients_list = [int(c) for c in opts.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as work:
        work = Path(work)
        model = vs_vllm.build_checkpoint(work / "model")
        convert(opts.llama_cpp, work / "model", work / "model.gguf")
        vocab = model["vocab_size"]
        ctx = {"work": work, "model_dir": work / "model", "gguf": work / "model.gguf", "ids": iter(range(10**6)),
               "requests": {c: requests(REQUESTS_PER_CLIENT * c, PROMPT_TOKENS, NEW_TOKENS, vocab, seed=c)
                            for c in clients_list},
               "warmup": {c: requests(c, 32, 8, vocab, seed=-c) for c in clients_list}}
        results = {"model": model, "llama_cpp": llama_cpp_version(opts.llama_cpp), "threads": opts.threads,
                   "versions": versions("hf_paged", "torch", "transformers"), "by_concurrency": {}}
        for clients in clients_list:
            runs = {"hf_paged": [], "llama.cpp": []}
            for r in range(opts.rounds):
                for system in (("hf_paged", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "hf_paged")):
                    runs[system].append(run_one(system, clients, ctx, opts))
                    print(f"{clients} clients, round {r + 1}, {system}: {runs[system][-1]['tokens_per_s']:.0f} tok/s",
                          flush=True)
            summary = {s: {k: statistics.median(run[k] for run in rs) for k in rs[0] if k != "tokens"}
                       for s, rs in runs.items()}
            summary["ratio"] = summary["hf_paged"]["tokens_per_s"] / summary["llama.cpp"]["tokens_per_s"]
            summary["rounds"] = {s: [round(run["tokens_per_s"], 1) for run in rs] for s, rs in runs.items()}
            summary["agreement"] = vs_vllm.agreement(runs["hf_paged"][0]["tokens"], runs["llama.cpp"][0]["tokens"])
            results["by_concurrency"][clients] = summary
            print(f"{clients} clients: hf_paged / llama.cpp = {summary['ratio']:.2f}x "
                  f"(p99 latency {summary['hf_paged']['latency_s_p99']:.2f} vs "
                  f"{summary['llama.cpp']['latency_s_p99']:.2f} s), agreement {summary['agreement']}", flush=True)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(results, indent=1))
    print(f"written {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
