"""``hf_paged.engine.beam_search`` against transformers' own beam search.

Two drivers feed :class:`BeamSearchState`:

* **replay**: the per-step log-probs that ``generate(output_scores=True)`` recorded for its running
  beams are fed back row for row. If the state keeps its running beams in transformers' order,
  these are exactly the rows it needs, so the outputs must be bit-identical (scores compared
  with ``==``) and the number of steps must equal ``len(out.scores)``.
* **live**: a model drives the state like the engine will, recomputing every running beam's
  full sequence with a plain forward each step (no cache), so the log-probs differ from
  ``generate``'s cached ones by float noise; sequences must still be equal and
  ``sequences_scores`` equal within 1e-5 relative (5e-5 absolute for small scores).

The tiny Llama models mostly have their ``lm_head`` scaled up (sharper distributions) and EOS set
to tokens the model often predicts, so that beams really finish early, at different lengths,
and ``early_stopping`` True / False / "never" really differ; ``test_cases_exercise_early_finishing``
checks that they do. One unscaled model (flatter distributions) is kept too.
"""

from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
import transformers

from hf_paged.engine.beam_search import BeamSearchState, apply_min_new_tokens, candidate_count, generate_fill_token
from tests.helpers.tiny_models import single_threaded_torch

VOCAB = 96
MAX_NEW = 14


# ----------------------------------------------------------------------------- models and cases


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread, and a shared 2-core box is not oversubscribed."""
    with single_threaded_torch():
        yield


@functools.lru_cache(maxsize=None)
def _model(name: str) -> transformers.PreTrainedModel:
    seed, head_scale = {"sharp0": (0, 3.0), "sharp1": (1, 3.0), "flat0": (0, 1.0)}[name]
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, initializer_range=0.3, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


@functools.lru_cache(maxsize=None)
def _frequent_tokens(name: str, prompt_seed: int, num_beams: int) -> tuple[int, ...]:
    """The tokens most frequent in the outputs of a beam search without EOS (first token excluded).

    Declaring them EOS makes many beams finish early, at different lengths.
    """
    prompt = torch.tensor([_prompt(prompt_seed)])
    with torch.no_grad():
        out = _model(name).generate(prompt, num_beams=num_beams, num_return_sequences=num_beams, do_sample=False,
                                    max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0)
    counts = collections.Counter(out[:, prompt.shape[1] + 1:].flatten().tolist())
    return tuple(token for token, _ in counts.most_common(2))


def _eos(name: str, prompt_seed: int, num_beams: int, which: str) -> list[int]:
    top = _frequent_tokens(name, prompt_seed, num_beams)
    return {"f0": [top[0]], "f1": [top[1]], "f01": [top[0], top[1]]}[which]


@functools.lru_cache(maxsize=None)
def _prompt(seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(100 + seed)
    length = 5 + seed % 4
    return tuple(torch.randint(3, VOCAB, (length,), generator=g).tolist())


def _kwargs(num_beams, num_return, length_penalty, early_stopping, max_new, min_new):
    return dict(num_beams=num_beams, num_return_sequences=num_return, length_penalty=length_penalty,
                early_stopping=early_stopping, max_new_tokens=max_new, min_new_tokens=min_new)


@functools.lru_cache(maxsize=None)
def _reference(name, prompt_seed, eos, num_beams, num_return, length_penalty, early_stopping, max_new, min_new):
    """transformers' beam search: hypotheses [(tokens, score)], per-step log-probs, sequences, sequences_scores."""
    model, prompt = _model(name), torch.tensor([_prompt(prompt_seed)])
    with torch.no_grad():
        out = model.generate(
            prompt, do_sample=False, return_dict_in_generate=True, output_scores=True, eos_token_id=list(eos),
            pad_token_id=0, **_kwargs(num_beams, num_return, length_penalty, early_stopping, max_new, min_new),
        )
    plen = prompt.shape[1]
    lengths = (out.beam_indices >= 0).sum(1).tolist()  # generated length of each returned row
    hyps = []
    for row, length in enumerate(lengths):
        hyps.append((out.sequences[row, plen:plen + length].tolist(), out.sequences_scores[row].item()))
    return hyps, out.scores, out.sequences, out.sequences_scores


def _state(name, prompt_seed, eos, num_beams, num_return, length_penalty, early_stopping, max_new, min_new):
    return BeamSearchState(eos_token_ids=list(eos), prompt_len=len(_prompt(prompt_seed)),
                           **_kwargs(num_beams, num_return, length_penalty, early_stopping, max_new, min_new))


def _drive_live(state: BeamSearchState, model, prompt: tuple[int, ...]) -> int:
    """Run the search with plain full-sequence forwards; checks the step() contract on the way."""
    steps = 0
    while True:
        before = state.running
        if steps == 0:
            rows = [list(prompt)]  # the first step may pass the prompt's row once
        else:
            rows = [list(prompt) + tokens for tokens in before]
        with torch.no_grad():
            logits = model(torch.tensor(rows, device=model.device)).logits[:, -1]
        nxt = state.step(torch.log_softmax(logits.float(), -1))
        steps += 1
        if not nxt:
            assert state.done and state.running == []
            return steps
        assert not state.done and len(nxt) == state.num_beams
        assert not any(token in state.eos_token_ids for _, token in nxt)
        assert state.running == [before[p] + [t] for p, t in nxt]


def _assert_same(ours, ref):
    """Same token sequences; scores within 1e-5 relative or 5e-5 absolute.

    The absolute floor is for small scores: the sharp models' logits reach tens, so the plain
    forward's float noise is a few 1e-6 per token, against scores down to -0.03 (seen: 1.3e-5
    relative, 1.1e-5 absolute on -0.845). The replay test is the exact comparison.
    """
    assert [h[0] for h in ours] == [h[0] for h in ref], (ours, ref)
    assert [h[1] for h in ours] == pytest.approx([h[1] for h in ref], rel=1e-5, abs=5e-5), (ours, ref)


# The main matrix: (model, prompt seed, num_beams, EOS choice) x length_penalty x early_stopping;
# num_return_sequences cycles through 1..num_beams across the cases. Groups chosen so that beams
# finish early and the early_stopping modes lead to different outputs or stopping steps.
GROUPS = [
    ("sharp0", 1, 2, "f1"), ("sharp0", 3, 2, "f01"), ("sharp0", 1, 4, "f01"), ("sharp0", 2, 4, "f01"),
    ("sharp0", 1, 6, "f01"), ("sharp0", 3, 6, "f01"), ("sharp1", 2, 2, "f0"), ("sharp1", 1, 2, "f01"),
    ("flat0", 3, 4, "f0"), ("flat0", 1, 6, "f1"), ("sharp1", 0, 4, "f01"),
]
LENGTH_PENALTIES = [0.0, 1.0, 2.0, -1.0]
EARLY_STOPPING = [True, False, "never"]


def _cases():
    cases = []
    for gi, (name, prompt_seed, k, eos) in enumerate(GROUPS):
        for li, lp in enumerate(LENGTH_PENALTIES):
            for ei, es in enumerate(EARLY_STOPPING):
                num_return = 1 + (gi + li + ei) % k
                cases.append((name, eos, prompt_seed, k, num_return, lp, es, MAX_NEW, 0))
    # min_new_tokens, with EOS ids that would otherwise end beams before it
    for name, prompt_seed, k, eos in [("sharp1", 2, 2, "f0"), ("sharp0", 1, 4, "f01"), ("flat0", 1, 6, "f1")]:
        for min_new in (3, 6):
            for es in EARLY_STOPPING:
                cases.append((name, eos, prompt_seed, k, k, 1.0, es, MAX_NEW, min_new))
    # tiny length limits: every candidate stops at the last step
    for max_new in (1, 2):
        for k in (2, 4):
            cases.append(("sharp0", "f01", 1, k, k, 1.0, False, max_new, 0))
    return cases


CASES = _cases()


def _case_id(case):
    name, eos, prompt_seed, k, m, lp, es, max_new, min_new = case
    return f"{name}-eos_{eos}-p{prompt_seed}-k{k}-m{m}-lp{lp}-es_{es}-max{max_new}-min{min_new}"


def _resolve(case):
    name, eos, prompt_seed, k, *rest = case
    return (name, prompt_seed, tuple(_eos(name, prompt_seed, k, eos)), k, *rest)


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_replay_is_bit_exact(case):
    args = _resolve(case)
    ref, step_log_probs, ref_sequences, ref_scores = _reference(*args)
    state = _state(*args)
    for i, log_probs in enumerate(step_log_probs):
        assert not state.done
        nxt = state.step(log_probs)
        assert (nxt == []) == (i == len(step_log_probs) - 1), "search ended at a different step"
    assert state.done
    ours = state.finalize()
    assert ours == ref  # tokens and float32 scores, exactly
    sequences, scores = state.sequences_for_output(list(_prompt(args[1])), pad_token_id=0)
    assert torch.equal(sequences, ref_sequences) and torch.equal(scores, ref_scores)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_live_model_matches_generate(case):
    args = _resolve(case)
    ref, step_log_probs, *_ = _reference(*args)
    state = _state(*args)
    steps = _drive_live(state, _model(args[0]), _prompt(args[1]))
    _assert_same(state.finalize(), ref)
    assert steps == len(step_log_probs)


def test_cases_exercise_early_finishing():
    """The matrix really covers beams ending early, early stops, and the early_stopping modes differing."""
    ended_with_eos_early = stopped_before_limit = modes_differ = both_eos_ids_end = min_new_binds = 0
    by_config = {}
    for case in CASES:
        args = _resolve(case)
        ref, steps, *_ = _reference(*args)
        eos, max_new, min_new = args[2], args[7], args[8]
        ended = {h[0][-1] for h in ref if h[0] and h[0][-1] in eos and len(h[0]) < max_new}
        ended_with_eos_early += bool(ended)
        both_eos_ids_end += len(ended) >= 2
        stopped_before_limit += len(steps) < max_new
        if min_new:
            relaxed = _reference(*args[:8], 0)[0]
            min_new_binds += any(0 < len(h[0]) <= min_new for h in relaxed) and relaxed != ref
            assert all(len(h[0]) > min_new for h in ref)
        key = (*args[:4], *args[5:6], max_new, min_new)  # all but num_return_sequences and early_stopping
        by_config.setdefault(key, {})[args[6]] = (ref[0], len(steps))
    for outcomes in by_config.values():
        if len(outcomes) == 3:
            modes_differ += len({repr(v) for v in outcomes.values()}) > 1
    # (transformers 5.17 and 5.24 both give 120, 76, 42, 28, 14)
    assert ended_with_eos_early >= 60
    assert stopped_before_limit >= 30
    assert modes_differ >= 15
    assert both_eos_ids_end >= 5
    assert min_new_binds >= 4


def test_width_one_equals_greedy():
    """num_beams=1 (generate then runs greedy search): same tokens; the score is sum(log p)/len**lp."""
    ended_early = 0
    for name, prompt_seed, eos_which, lp in [("sharp1", 2, "f0", 1.0), ("sharp0", 1, "f01", 2.0),
                                             ("flat0", 3, "f0", 0.0), ("sharp0", 1, "f1", -1.0)]:
        model, prompt, eos = _model(name), _prompt(prompt_seed), _eos(name, prompt_seed, 2, eos_which)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                 pad_token_id=0, return_dict_in_generate=True, output_scores=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        ended_early += len(tokens) < MAX_NEW  # a batch of one stops right at EOS, unpadded
        total = torch.zeros((), dtype=torch.float32)
        for step, token in enumerate(tokens):
            total = total + torch.log_softmax(out.scores[step][0].float(), -1)[token]
        state = BeamSearchState(num_beams=1, num_return_sequences=1, length_penalty=lp, early_stopping=True,
                                eos_token_ids=eos, prompt_len=len(prompt), max_new_tokens=MAX_NEW)
        _drive_live(state, model, prompt)
        _assert_same(state.finalize(), [(tokens, (total / len(tokens) ** lp).item())])
    assert ended_early >= 2


# ----------------------------------------------------------------------------- negative controls


def test_negative_control_wrong_length_penalty():
    args = _resolve(("sharp0", "f01", 1, 4, 4, 1.0, False, MAX_NEW, 0))
    ref, *_ = _reference(*args)
    state = _state(*args)
    state.length_penalty = 0.5
    _drive_live(state, _model(args[0]), _prompt(args[1]))
    ours = state.finalize()
    with pytest.raises(AssertionError):
        _assert_same(ours, ref)


def test_negative_control_no_initial_penalty():
    """Without the [0, -1e9, ...] start every beam expands the prompt: duplicate beams, other results."""
    args = _resolve(("sharp0", "f01", 1, 4, 4, 1.0, False, MAX_NEW, 0))
    ref, *_ = _reference(*args)
    state = _state(*args)
    state._running_scores.zero_()
    _drive_live(state, _model(args[0]), _prompt(args[1]))
    ours = state.finalize()
    with pytest.raises(AssertionError):
        _assert_same(ours, ref)
    assert len({tuple(h[0]) for h in ours}) < len(ours)  # duplicates


def test_negative_control_min_new_tokens_ignored():
    args = _resolve(("sharp1", "f0", 2, 2, 2, 1.0, True, MAX_NEW, 6))
    ref, *_ = _reference(*args)
    state = _state(*args[:8], 0)
    _drive_live(state, _model(args[0]), _prompt(args[1]))
    with pytest.raises(AssertionError):
        _assert_same(state.finalize(), ref)


# ----------------------------------------------------------------------------- interface


def test_interface_basics():
    state = BeamSearchState(num_beams=3, num_return_sequences=2, length_penalty=1.0, early_stopping=False,
                            eos_token_ids=[1, 5], prompt_len=4, max_new_tokens=3)
    assert state.num_candidates == candidate_count(3, 2) == 9
    assert state.running == [[], [], []] and not state.done
    assert state.running_scores == [0.0, -1e9, -1e9]
    with pytest.raises(RuntimeError):
        state.finalize()
    with pytest.raises(ValueError):
        state.step(torch.zeros(2, 10))  # wrong number of rows
    with pytest.raises(ValueError):
        state.step(torch.zeros(3, 10, dtype=torch.float64))
    # Hand-made distributions over 10 tokens: first token 5 (an EOS) is best, then 7, 8, 9;
    # afterwards EOS is unlikely and 7 is best.
    first = torch.log_softmax(torch.tensor([0.0] * 5 + [4.0, 0.0, 3.0, 2.5, 2.0]), -1)[None]
    later = torch.log_softmax(torch.tensor([0.0] * 5 + [-20.0, 0.0, 3.0, 2.5, 2.0]), -1).expand(3, -1)
    nxt = state.step(first)  # one row at the first step
    assert nxt == [(0, 7), (0, 8), (0, 9)]
    assert state.running == [[7], [8], [9]]
    assert state.finished_hypotheses() == [([5], first[0, 5].item())]
    nxt = state.step(later)
    assert nxt == [(0, 7), (1, 7), (0, 8)]  # 7+7, 8+7, 7+8 (score ties 8+7 vs 7+8 go to the lower index)
    assert state.running == [[7, 7], [8, 7], [7, 8]]
    assert state.step(later) == []  # max_new_tokens reached
    assert state.done and state.running == []
    with pytest.raises(RuntimeError):
        state.step(later)
    best = state.finalize()
    assert [tokens for tokens, _ in best] == [[5], [7, 7, 7]]
    expected = (first[0, 7] + later[0, 7] + later[0, 7]) / 3
    assert best[0][1] == first[0, 5].item() and best[1][1] == pytest.approx(expected.item(), rel=1e-6)


def test_interface_validation():
    common = dict(length_penalty=1.0, eos_token_ids=[1], prompt_len=3, max_new_tokens=4)
    with pytest.raises(ValueError):
        BeamSearchState(num_beams=2, num_return_sequences=3, early_stopping=False, **common)
    with pytest.raises(ValueError):
        BeamSearchState(num_beams=2, num_return_sequences=1, early_stopping="sometimes", **common)
    with pytest.raises(ValueError):
        BeamSearchState(num_beams=2, num_return_sequences=1, early_stopping=False,
                        **{**common, "max_new_tokens": 0})


def test_apply_min_new_tokens():
    lp = torch.log_softmax(torch.randn(2, 8), -1)
    masked = apply_min_new_tokens(lp, generated_len=1, min_new_tokens=2, eos_token_ids=[3, 5])
    assert torch.isinf(masked[:, [3, 5]]).all() and (masked[:, [3, 5]] < 0).all()
    keep = [0, 1, 2, 4, 6, 7]
    assert torch.equal(masked[:, keep], lp[:, keep])
    assert apply_min_new_tokens(lp, generated_len=2, min_new_tokens=2, eos_token_ids=[3]) is lp
    assert math.isfinite(lp[0, 3].item())  # the input is not modified


def test_generate_fill_token():
    """transformers fills with ``pad_token_id or eos[0]``: a pad id of 0 is replaced by the first EOS."""
    assert generate_fill_token(5, [1, 2]) == 5
    assert generate_fill_token(0, [7, 8]) == 7
    assert generate_fill_token(None, [7]) == 7
    assert generate_fill_token(3, []) == -1
    # and against generate, with a non-zero pad id
    name, prompt_seed, k = "sharp1", 2, 2
    prompt, eos = _prompt(prompt_seed), _eos(name, prompt_seed, k, "f0")
    with torch.no_grad():
        out = _model(name).generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, max_new_tokens=MAX_NEW,
                                    do_sample=False, eos_token_id=eos, pad_token_id=5, return_dict_in_generate=True,
                                    output_scores=True)
    state = BeamSearchState(num_beams=k, num_return_sequences=k, length_penalty=1.0, early_stopping=False,
                            eos_token_ids=eos, prompt_len=len(prompt), max_new_tokens=MAX_NEW)
    for log_probs in out.scores:
        state.step(log_probs)
    sequences, scores = state.sequences_for_output(list(prompt), pad_token_id=5)
    assert (sequences == 5).any()  # a hypothesis ended early and was filled
    assert torch.equal(sequences, out.sequences) and torch.equal(scores, out.sequences_scores)
