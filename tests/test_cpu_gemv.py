"""The C products of a few rows (``hf_paged.kernels.cpu_gemv``): against ``F.linear`` at every row
count it takes (odd sizes, bias or none, both builds), a row's bits independent of the other rows
and of the threads, its refusals, its C++ operator (the loop's bits where it takes the tensors,
``F.linear``'s elsewhere, compiled too; a library without it where no C++ compiler works), the
engine's few-sequence steps running their layer and LM-head products through it with stock
generate()'s tokens, and negative controls."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hf_paged import LLMEngine
from hf_paged.engine import cpu_linear
from hf_paged.kernels import cpu_build, cpu_gemv, cpu_ops
from tests.helpers.few_rows import engine_greedy, stock_greedy
from tests.helpers.tiny_models import build


@pytest.mark.parametrize("shape", [(688, 256), (37, 101), (5, 16)], ids=["layer", "odd", "tiny"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_matches_the_torch_linear_at_every_row_count(rows_built, shape, with_bias):
    g = torch.Generator().manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    for rows in range(1, cpu_gemv.max_rows() + 1):
        x = torch.randn(1, rows, in_features, generator=g)
        ours = cpu_gemv.linear_rows(x, weight, bias)
        assert ours.shape == (1, rows, out_features)
        torch.testing.assert_close(ours, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_a_rows_result_depends_on_no_other_row_nor_on_the_threads(rows_built):
    """What lets a sequence's tokens not depend on which others share its step (up to the row limit)."""
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(301, 264, generator=g), torch.randn(301, generator=g)  # 301: tiles of one row too
    x = torch.randn(cpu_gemv.max_rows(), 264, generator=g)
    together = cpu_gemv.linear_rows(x, weight, bias)
    for rows in range(1, cpu_gemv.max_rows() + 1):
        assert torch.equal(cpu_gemv.linear_rows(x[:rows], weight, bias), together[:rows])
    assert torch.equal(torch.cat([cpu_gemv.linear_rows(row[None], weight, bias) for row in x]), together)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_gemv.linear_rows(x, weight, bias), together)
    finally:
        torch.set_num_threads(threads)


def test_what_it_does_not_take_is_refused_by_name(rows_built):
    weight = torch.randn(8, 16)
    assert cpu_gemv.supports(torch.randn(2, 16), weight, None)
    refused = {
        "too many rows": (torch.randn(cpu_gemv.max_rows() + 1, 16), weight, None),
        "no rows": (torch.randn(0, 16), weight, None),
        "float64": (torch.randn(2, 16, dtype=torch.float64), weight.double(), None),
        "a transposed weight": (torch.randn(2, 8), weight.t(), None),
        "columns that do not fit": (torch.randn(2, 15), weight, None),
        "a bias of other rows": (torch.randn(2, 16), weight, torch.randn(9)),
    }
    for what, (x, w, b) in refused.items():
        assert not cpu_gemv.supports(x, w, b) and cpu_gemv.try_linear_rows(x, w, b) is None, what
        with pytest.raises(ValueError, match="linear_rows: x .* float32 CPU tensors of 1 to"):
            cpu_gemv.linear_rows(x, w, b)


@pytest.fixture
def linear_op(rows_built):
    op = cpu_gemv.linear_op()
    if op is None:
        pytest.skip(f"the C++ operator does not build here: {cpu_build.ops_failure()}")
    return op


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_operator_is_the_loop_where_it_takes_the_tensors_and_f_linear_elsewhere(linear_op, with_bias):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 264, generator=g)
    bias = torch.randn(300, generator=g) if with_bias else None
    limit = cpu_gemv.max_rows()
    before = cpu_ops.products_in_c()
    for rows in range(1, limit + 1):
        x = torch.randn(2, rows, 264, generator=g)[:1]
        assert torch.equal(linear_op(x, weight, bias, limit), cpu_gemv.linear_rows(x, weight, bias)), rows
    assert cpu_ops.products_in_c() - before == limit
    x = torch.randn(1, 3, 264, generator=g)
    not_taken = {
        "more rows than the build takes": (torch.randn(1, limit + 1, 264, generator=g), weight, bias, limit + 1),
        "more rows than asked for": (x, weight, bias, 2),
        "a transposed weight": (x, weight.t().contiguous().t(), bias, limit),
        "float64": (x.double(), weight.double(), None if bias is None else bias.double(), limit),
    }
    for what, (x, w, b, most) in not_taken.items():
        assert torch.equal(linear_op(x, w, b, most), torch.nn.functional.linear(x, w, b)), what
    assert cpu_ops.products_in_c() - before == limit, "a product it does not take ran in C"
    x = torch.randn(2, 264, generator=g).t().contiguous().t()  # rows not contiguous: copied, then the loop
    assert torch.equal(linear_op(x, weight, bias, limit), cpu_gemv.linear_rows(x.contiguous(), weight, bias))
    compiled = torch.compile(lambda x: linear_op(x, weight, bias, limit), fullgraph=True)
    x = torch.randn(1, 1, 264, generator=g)
    assert torch.equal(compiled(x), cpu_gemv.linear_rows(x, weight, bias))


def test_negative_control_the_operator_compared_with_sgemm_differs_in_the_last_bits(linear_op):
    """The comparisons above are bit for bit: the loop's sums are not sgemm's, so comparing with the
    wrong one of the two would have failed."""
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(300, 264, generator=g), torch.randn(1, 4, 264, generator=g)
    assert not torch.equal(linear_op(x, weight, None, 4), torch.nn.functional.linear(x, weight))


def test_without_a_cpp_compiler_the_library_builds_without_the_operator(rows_built, tmp_path):
    if rows_built != "native":
        pytest.skip("one build is enough")
    code = """
        import torch
        from hf_paged.kernels import cpu_build, cpu_gemv, cpu_ops
        assert cpu_gemv.ready() and cpu_gemv.linear_op() is None
        print(cpu_build.ops_failure())
        from hf_paged.engine import cpu_linear
        assert cpu_linear.few_row_call(traced=True) is torch.ops.hf_paged.few_row_linear
        assert cpu_linear.few_row_call(traced=True, onednn=True) is torch.ops.hf_paged.onednn_linear
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_PAGED_CACHE": str(tmp_path), "CXX": "/nonexistent/c++"},
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    assert "/nonexistent/c++" in done.stdout


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn-layers", "sgemm-layers"])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_few_sequence_steps_run_their_products_in_c_with_stock_tokens(rows_built, monkeypatch, compile, onednn):
    """Decode steps of 3 sequences: every layer linear (whether oneDNN takes the layers' larger
    products or sgemm does: ``onednn_layers``) and the LM head (at most ``HEAD_GEMV_MAX_ROWS``
    rows) multiply in C, eager or inside the compiled body, and the tokens are stock generate()'s;
    the model is stock again afterwards."""
    model = build("llama")
    stock = copy.deepcopy(model)
    seen, real = set(), cpu_gemv.try_linear_rows

    def counted(x, weight, bias=None):
        out = real(x, weight, bias)
        if out is not None:
            seen.add(id(weight))
        return out

    monkeypatch.setattr(cpu_gemv, "try_linear_rows", counted)
    engine = LLMEngine(model, block_size=4, onednn_layers=onednn, compile=compile)
    assert engine.stats()["compiled"] is compile and engine.stats()["onednn_layers"] is onednn
    seen.clear()  # compiling ran the body on dummy tokens
    before = cpu_ops.products_in_c()
    assert engine_greedy(engine) == stock_greedy(stock)
    layers = {id(m.weight) for m in engine.runner.layer_linears}
    if cpu_gemv.linear_op() is None:  # through Python (hf_paged::onednn_linear, few_row_linear)
        assert layers and layers <= seen, "a layer product of a decode step did not run in C"
    else:  # through the C++ operator: 9 decode steps of 3 rows, every layer product in C
        assert layers and not layers & seen and cpu_ops.products_in_c() - before >= 9 * len(layers)
    assert id(model.lm_head.weight) in seen, "the LM head of a decode step did not run in C"
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert engine.stats()["blocks_free"] == engine.stats()["blocks_total"]


def test_negative_control_the_operators_products_reach_the_tokens(linear_op, monkeypatch):
    """The layer products of an engine's steps come from ``cpu_gemv.linear_op()``: the same steps
    with its products missing their last input column do not give stock tokens."""
    model = build("llama")
    stock = stock_greedy(copy.deepcopy(model))

    def short(x, weight, bias, most):
        return linear_op(x[..., :-1].contiguous(), weight[:, :-1].contiguous(), bias, most)

    monkeypatch.setattr(cpu_gemv, "linear_op", lambda: short)
    assert engine_greedy(LLMEngine(model, block_size=4, onednn_layers=False, compile=False)) != stock


def test_negative_control_a_product_missing_its_last_column_changes_tokens(rows_built, monkeypatch):
    """What the test above compares can fail: the same steps with the C products dropping their
    last input column (a tail the kernel skipped) do not give stock tokens."""
    model = build("llama")
    stock = stock_greedy(copy.deepcopy(model))
    real = cpu_gemv.try_linear_rows

    def short(x, weight, bias=None):
        return real(x[..., :-1].contiguous(), weight[:, :-1].contiguous(), bias)

    monkeypatch.setattr(cpu_gemv, "try_linear_rows", short)
    engine = LLMEngine(model, block_size=4, onednn_layers=True, compile=False)
    assert engine_greedy(engine) != stock


def test_larger_steps_keep_onednn_for_the_head(rows_built, monkeypatch):
    """Past ``HEAD_GEMV_MAX_ROWS`` rows the head runs on oneDNN (the C loop reads the weight once for
    up to ``max_rows()`` rows but multiplies slower than oneDNN's packed kernel there)."""
    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN linear")
    head = torch.nn.Linear(64, 300, bias=False)
    calls = []
    real = cpu_gemv.try_linear_rows
    monkeypatch.setattr(cpu_gemv, "try_linear_rows", lambda *a: calls.append(a[0].shape) or real(*a))
    rows = cpu_linear.HEAD_GEMV_MAX_ROWS
    few, many = torch.randn(1, rows, 64), torch.randn(1, rows + 1, 64)
    with torch.no_grad(), cpu_linear.onednn_linears((head,)):
        switched = head(few), head(many)
    with torch.no_grad():
        for ours, x in zip(switched, (few, many)):
            torch.testing.assert_close(ours, head(x), rtol=1e-5, atol=1e-4)
    assert calls == [few.shape]
