"""The C decode read on CPU (``hf_paged.kernels.cpu_decode``, issue 22): float32 attention of one
query per sequence straight over the block pools. Against the torch reference on scattered tables
(windows, sinks, grouped heads, one and two threads), token-exact against stock generate() in the
engine (plain, sliding-window and sink models), its refusals, its build cache, the fallback when no
compiler works, and negative controls that show each comparison can fail."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.kernels import cpu_build, cpu_decode
from hf_paged.kernels.reference import paged_attention_decode_ref
from tests.helpers.tiny_models import build
from tests.helpers.variant_models import build_variant


def _built_or_skip(kv_heads, group, head_dim, block_size):
    if not cpu_decode.ready(kv_heads, group, head_dim, block_size):
        pytest.skip(f"no C compiler works here: {cpu_decode.failure()}")


def _case(kv_heads, group, head_dim, block_size, num_seqs, seed=0):
    """Pools of random K/V, scattered block tables padded with -1, and queries: the lengths cover a
    lone slot, full and partial last blocks and several blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks, width = 96, 5
    k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    base = [1, block_size, block_size + 1, 4 * block_size + 3, 7, 2 * block_size, 5 * block_size]
    lens = torch.tensor((base * num_seqs)[:num_seqs], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).int()
    for i, n in enumerate(lens.tolist()):
        tables[i, -(-n // block_size):] = -1  # padding past a sequence's blocks is never read
    q = torch.randn(num_seqs, kv_heads * group, head_dim, generator=g)
    sinks = torch.randn(kv_heads * group, generator=g) * 2
    return q, k_pool, v_pool, tables, lens, sinks


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size",  # head dim 20: the plain loops; 8: the 8-key path of
                         [(2, 4, 16, 32), (4, 1, 8, 16), (1, 3, 32, 16), (2, 2, 64, 128),  # the AVX2 build, the plain
                          (2, 3, 20, 12)])  # loops of 16 lanes; the rest the key-vector path (blocks of 16+)
@pytest.mark.parametrize("num_seqs", [2, 7])  # fewer sequences than 2x threads: split by K/V head
@pytest.mark.parametrize("options", [{}, {"sliding_window": 5}, {"sinks": True}, {"sliding_window": 19, "sinks": True}],
                         ids=["causal", "window", "sinks", "window+sinks"])
def test_the_read_equals_the_reference_on_scattered_blocks(kv_heads, group, head_dim, block_size, num_seqs, options,
                                                           threads, c_target):
    _built_or_skip(kv_heads, group, head_dim, block_size)
    q, k_pool, v_pool, tables, lens, sinks = _case(kv_heads, group, head_dim, block_size, num_seqs)
    kwargs = {**options, "sinks": sinks} if options.get("sinks") else options
    ref = paged_attention_decode_ref(q, k_pool, v_pool, tables.clamp(min=0), lens, 0.3, **kwargs)
    for n in (1, 2):
        threads(n)
        out = cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3, **kwargs)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # negative control: one slot more for a sequence whose last block has room changes its output
    bumped = lens.clone()
    bumped[0] += 1
    wrong = cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, bumped, 0.3, **kwargs)
    assert not torch.allclose(wrong[0], ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", [(2, 4, 32, 16), (4, 1, 8, 16)])
def test_slots_past_the_length_weigh_nothing(kv_heads, group, head_dim, block_size, c_target):
    """The unwritten end of a sequence's last block may hold anything (another sequence's old keys,
    or NaN after a failed step): the read's output does not change."""
    _built_or_skip(kv_heads, group, head_dim, block_size)
    q, k_pool, v_pool, tables, lens, _ = _case(kv_heads, group, head_dim, block_size, num_seqs=7)
    ref = cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3)
    for i, n in enumerate(lens.tolist()):
        if n % block_size:
            k_pool[tables[i, n // block_size], n % block_size:] = float("nan")
            v_pool[tables[i, n // block_size], n % block_size:] = float("nan")
    out = cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3)
    assert torch.equal(out, ref)
    # negative controls: a key or a value the sequence sees does reach its output
    k_pool[tables[2, 0], 0] += 3.0
    assert not torch.allclose(cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3)[2], ref[2])
    v_pool[tables[2, 0], 0] = float("nan")
    assert cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3)[2].isnan().any()


def test_tables_and_lengths_outside_the_pool_are_refused_before_anything_is_read():
    _built_or_skip(2, 4, 16, 32)
    q, k_pool, v_pool, tables, lens, _ = _case(2, 4, 16, 32, num_seqs=3)
    bad = tables.clone()
    bad[2, 1] = k_pool.shape[0]  # sequence 2 (33 tokens) reads its second block
    with pytest.raises(ValueError, match=r"sequence 2 reads block 96 \(entry 1 of its table\), outside the pool of 96 blocks"):
        cpu_decode.paged_decode_cpu(q, k_pool, v_pool, bad, lens, 0.3)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match=r"sequence 2 reads block -1 \(entry 1"):
        cpu_decode.paged_decode_cpu(q, k_pool, v_pool, bad, lens, 0.3)
    with pytest.raises(ValueError, match="sequence 1 has context length 161; its table holds 5 blocks of 32"):
        cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables.clamp(min=0), lens + torch.tensor([0, 129, 0]), 0.3)
    with pytest.raises(ValueError, match="context_lens"):
        cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens[:2], 0.3)
    # tensors the loop would read past: refused by the same checks supports() makes
    with pytest.raises(ValueError, match="does not fit pools of 2 heads of 16"):
        cpu_decode.paged_decode_cpu(torch.cat([q, q], -1), k_pool, v_pool, tables, lens, 0.3)
    with pytest.raises(ValueError, match="not float32"):
        cpu_decode.paged_decode_cpu(q, k_pool.double(), v_pool.double(), tables, lens, 0.3)
    with pytest.raises(ValueError, match="not in the contiguous"):
        cpu_decode.paged_decode_cpu(q, k_pool.transpose(0, 1), v_pool.transpose(0, 1), tables, lens, 0.3)


def test_supports_only_float32_cpu_pools_in_the_block_layout():
    _built_or_skip(2, 4, 16, 32)
    q, k_pool, v_pool, *_ = _case(2, 4, 16, 32, num_seqs=2)
    assert cpu_decode.supports(q, k_pool, v_pool)
    assert not cpu_decode.supports(q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16())
    heads_major = k_pool.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # storage's heads_major layout
    assert not cpu_decode.supports(q, heads_major, heads_major)
    assert not cpu_decode.supports(q[:, :, :8], k_pool, v_pool)
    # the one-check entry point: the read where it is supported, None where not (the caller reads otherwise)
    _, _, _, tables, lens, _ = _case(2, 4, 16, 32, num_seqs=2)
    assert torch.equal(cpu_decode.try_paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3),
                       cpu_decode.paged_decode_cpu(q, k_pool, v_pool, tables, lens, 0.3))
    for refused in ((q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16()), (q, heads_major, heads_major),
                    (q[:, :, :8], k_pool, v_pool)):
        assert cpu_decode.try_paged_decode_cpu(*refused, tables, lens, 0.3) is None


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_loading_the_read_leaves_denormals_and_openmp_to_torch(tmp_path):
    """Built with -ffast-math, linked without it: gcc's crtfastmath would switch the whole process to
    flush-to-zero. And one OpenMP runtime: torch's (two would each keep a pool of spinning threads)."""
    result = _run_python("""
        import torch
        from hf_paged.kernels import cpu_decode
        tiny = torch.tensor(1e-40)
        assert (tiny * 1.0).item() != 0
        assert cpu_decode.ready(2, 4, 16, 32), cpu_decode.failure()
        assert (tiny * 1.0).item() != 0, "loading the read turned on flush-to-zero"
        maps = [line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line]
        print(sorted(set(maps)))
        assert len(set(maps)) == 1, maps
    """, HF_PAGED_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr


def test_a_build_is_cached_on_disk_and_a_missing_compiler_is_named(tmp_path):
    first = _run_python("""
        from hf_paged.kernels import cpu_decode
        assert cpu_decode.ready(2, 4, 16, 32), cpu_decode.failure()
    """, HF_PAGED_CACHE=str(tmp_path))
    if first.returncode != 0:
        pytest.skip(f"no C compiler works here: {first.stderr.strip().splitlines()[-1]}")
    built = list((tmp_path / "kernels").glob("cpu_attention-*.so"))
    assert len(built) == 1
    # in a fresh process with no working compiler: the same layout loads the cached library; a layout
    # not built yet is refused with the reason, and nothing else breaks
    again = _run_python("""
        from hf_paged.kernels import cpu_decode
        assert cpu_decode.ready(2, 4, 16, 32), cpu_decode.failure()
        assert not cpu_decode.ready(2, 4, 16, 64)
        print(cpu_decode.failure())
    """, HF_PAGED_CACHE=str(tmp_path), CC="/nonexistent/cc")
    assert again.returncode == 0, again.stderr
    assert "/nonexistent/cc" in again.stdout


def test_the_temporary_build_folder_is_ours_alone(tmp_path, monkeypatch):
    """Where the cache folder cannot be made, builds go to ``$TMPDIR/hf_paged-<uid>``: a predictable
    name, so a folder there that another user made, or that others can write to, is not used (the
    libraries in it get loaded); a fresh private folder is."""
    from hf_paged.kernels import cpu_build

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("HF_PAGED_CACHE", str(blocked))  # mkdir under a file fails: the fallback is taken
    monkeypatch.setattr(cpu_build.tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"hf_paged-{os.getuid()}"
    fresh = cpu_build._cache_dir()
    assert fresh == planted / "kernels" and (planted.stat().st_mode & 0o777) == 0o700  # made ours alone: used
    planted.chmod(0o777)  # others may write to it now
    elsewhere = cpu_build._cache_dir()
    assert planted not in elsewhere.parents and elsewhere.is_dir()
    assert (elsewhere.parent.stat().st_mode & 0o777) == 0o700 and elsewhere.parent.stat().st_uid == os.getuid()
    if os.geteuid() == 0:  # one made by another user, with our mode
        planted.chmod(0o700)
        os.chown(planted, 12345, 12345)
        assert planted not in cpu_build._cache_dir().parents


# ------------------------------------------------------------------------------------ the engine
PROMPTS = [list(range(3, 3 + n)) for n in (70, 41, 5, 33)] + [[9] * 64]


def _engine_tokens(model, monkeypatch, read: str = "c", block_size: int = 16, new: int = 12):
    engine = LLMEngine(model, block_size=block_size)
    engine.runner.decode_read = read
    calls = []

    def counted(original):  # a read the C library did (the general path's, or a decode step's shortcut)
        def read(*args, **kwargs):
            out = original(*args, **kwargs)
            calls.extend([1] if out is not None else [])
            return out
        return read

    with monkeypatch.context() as patched:
        for name in ("paged_decode_cpu", "try_paged_decode_cpu"):
            patched.setattr(cpu_decode, name, counted(getattr(cpu_decode, name)))
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=new, temperature=0), use_tqdm=False)
    assert engine.kv.num_used_blocks() == 0
    return [o.outputs[0].token_ids for o in outs], calls


def _stock(stock, new: int = 12):
    return [stock.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt_oss"])  # plain, a sliding window, sinks and a window
def test_engine_with_the_c_read_equals_stock_generate(name, monkeypatch, c_target):
    model = build_variant(name) if name == "gpt_oss" else build(name)
    stock = _stock(copy.deepcopy(model))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _built_or_skip(config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads, head_dim, 16)
    tokens, calls = _engine_tokens(model, monkeypatch)
    assert len(calls) >= 11 * config.num_hidden_layers, "the decode steps did not take the C read"
    assert tokens == stock
    gathered, calls = _engine_tokens(model, monkeypatch, read="gather")
    assert not calls and gathered == stock


@pytest.mark.parametrize("measured", [True, False])
def test_auto_reads_take_the_c_reads_only_where_they_were_measured_faster(measured, monkeypatch):
    """An engine's default ("auto") reads take the C reads where ``cpu_build.auto_reads`` says they
    beat torch's (x86 with AVX2 or AVX-512), torch's elsewhere; the tokens are the same either way."""
    model = build("llama")
    config = model.config
    _built_or_skip(config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
                   config.hidden_size // config.num_attention_heads, 16)
    monkeypatch.setattr(cpu_build, "auto_reads", lambda: measured)
    tokens, calls = _engine_tokens(model, monkeypatch, read="auto")
    assert bool(calls) is measured
    assert tokens == _stock(copy.deepcopy(model))


@pytest.mark.parametrize("flags,expected", [(b"flags\t\t: fpu sse2 avx avx2 fma avx512f", True),
                                            (b"flags\t\t: fpu sse2 avx avx2 fma", True),
                                            (b"flags\t\t: fpu sse2 avx", False), (b"Features\t: fp asimd", False)])
def test_auto_reads_are_the_c_reads_on_x86_with_avx2_or_avx512(flags, expected, monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: flags)
    cpu_build.auto_reads.cache_clear()
    try:
        assert cpu_build.auto_reads() is expected
    finally:
        cpu_build.auto_reads.cache_clear()


def test_the_target_sets_the_vector_width(c_target):
    """A build for AVX2 has 8-lane vectors, one for a CPU with AVX-512 16: ``c_target`` runs the read
    tests with both builds where the CPU has AVX-512 (else the native build is the 8-lane one)."""
    _built_or_skip(2, 4, 32, 16)
    lanes = cpu_build.library((2, 4, 32, 16)).vector_lanes()
    wide = b"avx512f" in cpu_build.cpu_flags().split()
    assert lanes == (16 if c_target == "native" and wide else 8)


def test_a_named_target_that_cannot_be_built_is_named(tmp_path):
    result = _run_python("""
        from hf_paged.kernels import cpu_build
        assert cpu_build.library((2, 4, 32, 16)) is None
        print(cpu_build.failure())
    """, HF_PAGED_CACHE=str(tmp_path), HF_PAGED_CPU_MARCH="no-such-cpu")
    assert result.returncode == 0, result.stderr
    assert "no-such-cpu" in result.stdout


def test_negative_control_a_read_one_slot_short_changes_tokens(monkeypatch):
    model = build("llama")
    stock = _stock(copy.deepcopy(model))
    config = model.config
    _built_or_skip(config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads,
                   config.hidden_size // config.num_attention_heads, 16)

    def short(original):  # both entry points: the general path's and a decode step's shortcut
        def read(q, k, v, tables, lens, *args, **kwargs):
            return original(q, k, v, tables, (lens - 1).clamp(min=1), *args, **kwargs)
        return read

    for name in ("paged_decode_cpu", "try_paged_decode_cpu"):
        monkeypatch.setattr(cpu_decode, name, short(getattr(cpu_decode, name)))
    engine = LLMEngine(model, block_size=16)
    engine.runner.decode_read = "c"
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != stock
