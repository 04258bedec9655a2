"""Turning logits into tokens, a step's rows at once: penalties (repetition over prompt and output;
presence and frequency, OpenAI's, over the output only), temperature, top-k/top-p/min-p, seeded
draws.

Every operation is row by row (elementwise, or a reduction along a row), so a row's processed
logits do not depend on the other rows of the batch. A draw takes one uniform number per token
from the request's own ``torch.Generator`` when it has a seed (else from torch's global one) and
picks the token where it falls on the row's cumulative distribution (:func:`inverse_cdf`): one
random number per token rather than one per vocabulary entry (``torch.multinomial`` and the
exponential race draw 32,000 for a 32,000-word row, ~0.65 ms on a CPU core), so a request's tokens
depend only on its own logits and its own generator, whatever else is in the batch. Top-p looks for
its cut among the ``TOP_P_CANDIDATES`` most likely tokens first and sorts a whole row only when the
cut lies beyond them. Greedy rows (temperature 0) take the argmax. Log-probabilities reported are
those of the raw model distribution (before ``logit_bias``, penalties and temperature; a
constraint's mask is kept); they are computed only for requests that ask for them (as in vLLM,
``cumulative_logprob`` is None otherwise).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.engine.params import SamplingParams
from hf_paged.kernels import cpu_argmax

TOP_P_CANDIDATES = 128  # top-p's cut is looked for among this many most likely tokens before a full sort


@dataclass(frozen=True)
class RowSpec:
    """What one logits row is sampled with: its request's parameters, the sequence so far (for the
    penalties), how many tokens to draw from it (``n`` at a request's first token, else 1) and the
    request's generator (None: torch's global one)."""

    params: SamplingParams
    token_ids: Sequence[int]
    num_generated: int
    width: int = 1
    generator: torch.Generator | Sequence[torch.Generator] | None = None  # a sequence: one per token drawn


def sample(logits: torch.Tensor, rows: Sequence[RowSpec], eos_token_ids: Sequence[int]) -> list[list[int]]:
    """``rows[i].width`` tokens for each row of ``logits`` (``[len(rows), vocab]``, float32)."""
    return choose(process(logits, rows, eos_token_ids), rows)


def process(logits: torch.Tensor, rows: Sequence[RowSpec], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """The logits tokens are chosen from (``logits`` itself when nothing changes them, else a new
    tensor): penalized, EOS and stop tokens masked before ``min_new_tokens``; then, for the sampled
    rows, divided by the temperature and filtered by top-k, top-p, min-p."""
    masked = [i for i, row in enumerate(rows) if row.params.penalized or min_tokens_mask(row, eos_token_ids)]
    if masked:
        logits = logits.clone()
        for i in masked:
            row = rows[i]
            if row.params.penalized:
                _penalize(logits[i], row.params, row.token_ids, row.num_generated)
            # a stop id past the vocabulary can never be drawn: nothing to mask
            stops = [t for t in min_tokens_mask(row, eos_token_ids) if t < logits.shape[1]]
            if stops:
                logits[i, stops] = float("-inf")
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if not sampled:
        return logits
    every = len(sampled) == len(rows)
    index = None if every else torch.tensor(sampled, device=logits.device)
    params = [rows[i].params for i in sampled]
    temperatures = torch.tensor([[p.temperature] for p in params], dtype=logits.dtype, device=logits.device)
    scaled = logits / temperatures if every else logits.index_select(0, index).div_(temperatures)
    vocab = logits.shape[-1]
    _filter(scaled, [i for i, p in enumerate(params) if 0 < p.top_k < vocab],
            lambda x, sub: _top_k(x, [params[i].top_k for i in sub]))
    _filter(scaled, [i for i, p in enumerate(params) if p.top_p < 1.0],
            lambda x, sub: _top_p(x, [params[i].top_p for i in sub]))
    _filter(scaled, [i for i, p in enumerate(params) if p.min_p > 0.0],
            lambda x, sub: _min_p(x, [params[i].min_p for i in sub]))
    if every:
        return scaled
    return (logits if masked else logits.clone()).index_copy_(0, index, scaled)


def min_tokens_mask(row: RowSpec, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens a row may not draw yet: before ``min_new_tokens`` every token that would end it,
    EOS (unless ignored) and ``stop_token_ids`` (vLLM's ``min_tokens``)."""
    if row.num_generated >= row.params.min_new_tokens:
        return []
    return [*row.params.stop_token_ids, *(() if row.params.ignore_eos else eos_token_ids)]


def choose(logits: torch.Tensor, rows: Sequence[RowSpec]) -> list[list[int]]:
    """The tokens of processed logits: the argmax for greedy rows (``width`` times), else
    ``width`` independent draws from the row's softmax."""
    tokens: list[list[int] | None] = [None] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    if greedy:
        picks = logits[greedy].argmax(-1).tolist()
        for i, token in zip(greedy, picks):
            tokens[i] = [token] * rows[i].width
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        probs = (logits if len(sampled) == len(rows) else logits[sampled]).softmax(-1)
        owner = torch.tensor([j for j, i in enumerate(sampled) for _ in range(rows[i].width)], device=probs.device)
        picks = inverse_cdf(probs, owner, lambda: _uniforms([rows[i] for i in sampled], probs.device)).tolist()
        start = 0
        for i in sampled:
            tokens[i] = picks[start: start + rows[i].width]
            start += rows[i].width
    return tokens  # type: ignore[return-value]


def inverse_cdf(probs: torch.Tensor, owner: torch.Tensor, draw: Callable[[], torch.Tensor]) -> torch.Tensor:
    """For each draw ``u`` in [0, 1) (``draw()``; draw ``d`` is for row ``owner[d]`` of ``probs``),
    the first token whose cumulative probability exceeds ``u`` times the row's total: the row's
    categorical distribution, one random number per token. In two levels, so that no pass sums a
    whole row sequentially: the masses of ``ARGMAX_CHUNK``-token chunks (float32, vectorized), their
    running sums (float64), then the running sum inside the one chunk each draw falls in (float64).
    A token of probability 0 is never picked; a draw that rounds to the very top takes the last
    possible token. ``draw`` is called once every row is known to have something to sample, so a
    batch that raises here has taken nothing from any generator (its requests draw again alone)."""
    vocab, width = probs.shape[-1], ARGMAX_CHUNK
    running = per_chunk(probs, torch.sum).cumsum(-1, dtype=torch.float64).index_select(0, owner)
    total = running[:, -1:]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("nothing left to sample: every token of a row has probability 0 (or NaN) after its "
                         "masks and filters")
    draws = draw()
    target = torch.minimum(draws[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chunk = torch.searchsorted(running, target, right=True)  # [draws, 1]: the chunk holding the target
    before = torch.where(chunk > 0, running.gather(1, (chunk - 1).clamp_(min=0)), torch.zeros_like(target))
    columns = chunk * width + torch.arange(width, device=probs.device)
    inside = probs[owner[:, None], columns.clamp(max=vocab - 1)].masked_fill_(columns >= vocab, 0.0)
    within = inside.cumsum(-1, dtype=torch.float64)
    rest = torch.minimum(target - before, torch.nextafter(within[:, -1:], torch.zeros_like(total)))
    return chunk[:, 0] * width + torch.searchsorted(within, rest.clamp_(min=0), right=True)[:, 0]


def sample_generator(seed: int, index: int, device) -> torch.Generator:
    """The generator sample ``index`` of a seeded request draws every one of its tokens from: its
    tokens then do not depend on when its siblings are computed (a recompute preemption re-prefills
    them in other chunks, and one shared generator gave its numbers in another order). Sample 0's is
    the seed's own, so the first of ``n`` samples is the ``n=1`` draw (vLLM: sample i takes seed + i)."""
    if index == 0:
        return torch.Generator(device=device).manual_seed(seed)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def _uniforms(rows: Sequence[RowSpec], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per token to draw, in row order: a seeded row's from its own
    generator, the others' from torch's global one (drawn together)."""
    unseeded = sum(row.width for row in rows if row.generator is None)
    shared = torch.rand(unseeded, dtype=torch.float64, device=device) if unseeded else None
    parts, taken = [], 0
    for row in rows:
        if row.generator is None:
            parts.append(shared[taken: taken + row.width])
            taken += row.width
        elif isinstance(row.generator, torch.Generator):
            parts.append(torch.rand(row.width, dtype=torch.float64, device=device, generator=row.generator))
        else:  # a seeded request's first token: each sample's from its own generator
            parts.extend(torch.rand(1, dtype=torch.float64, device=device, generator=g) for g in row.generator)
    return torch.cat(parts)


def _filter(logits: torch.Tensor, sub: list[int], apply) -> None:
    """``apply(rows, sub)`` masks tokens of the rows ``sub`` of ``logits`` in place."""
    if not sub:
        return
    if len(sub) == len(logits):
        apply(logits, sub)
        return
    index = torch.tensor(sub, device=logits.device)
    part = logits.index_select(0, index)
    apply(part, sub)
    logits.index_copy_(0, index, part)


def _top_k(logits: torch.Tensor, ks: list[int]) -> None:
    values = torch.topk(logits, max(ks)).values
    kth = values.gather(1, torch.tensor(ks, device=logits.device)[:, None] - 1)
    logits.masked_fill_(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_ps: list[float]) -> None:
    """Keep each row's most likely tokens while the probability before them is at most top_p (the
    token that crosses it stays). The cut is looked for among the ``TOP_P_CANDIDATES`` most likely
    tokens; rows whose cut lies beyond them are sorted whole (the same prefix, further on)."""
    probs = logits.softmax(-1)
    vocab = logits.shape[-1]
    limit = torch.tensor(top_ps, dtype=probs.dtype, device=probs.device)[:, None]
    def dropped(values: torch.Tensor, order: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the most likely tokens (``values`` descending, ``order`` their ids): which tokens of
        the whole row go, and which of these are kept (to see whether the cut came)."""
        keep = values.cumsum(-1) - values <= limit
        return torch.ones(len(values), vocab, dtype=torch.bool, device=values.device).scatter_(1, order, ~keep), keep

    drop, keep = dropped(*torch.topk(probs, min(TOP_P_CANDIDATES, vocab)), limit)
    beyond = keep[:, -1] if keep.shape[-1] < vocab else torch.zeros_like(keep[:, -1])
    if bool(beyond.any()):
        rows = beyond.nonzero()[:, 0]
        drop[rows] = dropped(*torch.sort(probs[rows], descending=True), limit[rows])[0]
    logits.masked_fill_(drop, float("-inf"))


def _min_p(logits: torch.Tensor, min_ps: list[float]) -> None:
    probs = logits.softmax(-1)
    limit = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
    logits.masked_fill_(probs < limit * probs.amax(-1, keepdim=True), float("-inf"))


def _penalize(logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int], num_generated: int) -> None:
    """One row's repetition, presence and frequency penalties, in place."""
    repetition_penalty(logits, token_ids, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and num_generated:
        generated = torch.tensor(token_ids[-num_generated:], dtype=torch.long, device=logits.device)
        counts = torch.bincount(generated, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


ARGMAX_CHUNK = 128


def per_chunk(x: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``reduce`` (``torch.amax``, ``torch.sum``) over each chunk of ``ARGMAX_CHUNK`` columns of a
    contiguous 2D tensor: ``[rows, chunks]``, the last chunk possibly shorter. One vectorized pass."""
    rows, vocab = x.shape
    whole = vocab // ARGMAX_CHUNK
    out = reduce(x[:, : whole * ARGMAX_CHUNK].view(rows, whole, ARGMAX_CHUNK), -1)
    if vocab % ARGMAX_CHUNK:
        out = torch.cat([out, reduce(x[:, whole * ARGMAX_CHUNK:], -1, keepdim=True)], dim=1)
    return out


def chunk_maxima(logits: torch.Tensor | None) -> torch.Tensor | None:
    """The max of each chunk of ``ARGMAX_CHUNK`` columns of a 2D float tensor (:func:`per_chunk`),
    or None where :func:`argmax_rows` does not use them. A row's max is its chunks' max, so the
    non-finite check reads these instead of the whole logits again."""
    if logits is None or logits.dim() != 2 or not logits.is_contiguous():
        return None
    if logits.shape[1] // ARGMAX_CHUNK < 2 or not len(logits):
        return None
    return per_chunk(logits, torch.amax)


def argmax_rows(logits: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of a 2D float tensor without NaN (first maximum on ties), in two cheap
    passes: the max of each chunk of ``ARGMAX_CHUNK`` columns (``amax`` is vectorized on CPU, torch's
    ``argmax`` is not: 0.1 ms against 1.8 ms for 64 x 32000 on one core; ``maxima``: these, when the
    caller has them already), then the argmax inside the first chunk holding the row's max."""
    if maxima is None:
        maxima = chunk_maxima(logits)
    if maxima is None:
        return logits.argmax(-1)
    vocab = logits.shape[-1]
    first = maxima.argmax(-1)  # the first chunk whose max is the row's max holds the first maximum
    columns = (first[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=logits.device)).clamp_(max=vocab - 1)
    return columns.gather(1, logits.gather(1, columns).argmax(-1, keepdim=True))[:, 0]


def nonfinite_rows(logits: torch.Tensor | None, maxima: torch.Tensor | None = None) -> list[int]:
    """Rows of ``logits`` holding a NaN or +inf, or nothing finite at all (every entry -inf).

    One max per row finds all three (NaN and +inf propagate through it; a row of -inf has max
    -inf) and one host sync answers the common case: about 0.2 ms for 64 x 32000 on 2 CPU cores,
    nearly nothing when the rows' :func:`chunk_maxima` (which the argmax needs too) are given."""
    if logits is None or not len(logits):
        return []
    bad = ~torch.isfinite((logits if maxima is None else maxima).amax(-1))
    if not bool(bad.any()):
        return []
    return bad.nonzero()[:, 0].tolist()


class RowScan:
    """A step's logits rows read once before its tokens are chosen: the rows that hold nothing to
    choose from (a NaN or +inf, or no finite value: :attr:`bad`, whose requests fail) and the rows'
    argmax (:meth:`argmax`, for greedy rows). Float32 CPU rows get both from one C call
    (:mod:`hf_paged.kernels.cpu_argmax`: 9 against 45 us for one 32,000-wide row through the torch
    ops below, 97 against 196 us for 64 rows, on 2 cores); others from their :func:`chunk_maxima`,
    which the non-finite check and :func:`argmax_rows` share."""

    def __init__(self, logits: torch.Tensor | None):
        self.logits = logits
        self._picks = cpu_argmax.try_greedy_rows(logits) if logits is not None else None
        self._maxima = None if self._picks is not None else chunk_maxima(logits)
        self.bad = ([i for i, pick in enumerate(self._picks) if pick < 0] if self._picks is not None
                    else nonfinite_rows(logits, self._maxima))

    def argmax(self, rows: list[int]) -> list[int]:
        """The argmax of each of ``rows`` (rows not in :attr:`bad`), first maximum on ties."""
        if self._picks is not None:
            return [self._picks[row] for row in rows]
        logits, maxima = self.logits, self._maxima
        if rows != list(range(len(logits))):
            index = torch.tensor(rows, device=logits.device)
            logits = logits.index_select(0, index)
            maxima = None if maxima is None else maxima.index_select(0, index)
        return argmax_rows(logits, maxima).tolist()


def top_logprobs(raw_logprobs: torch.Tensor, token: int, k: int) -> list[tuple[int, float, int]]:
    """``(token, log-probability, rank)`` of the chosen token, then of the ``k`` most likely ones
    (put in a dict, the chosen one among them takes their entry). Ranks are 1-based in
    ``raw_logprobs``, as vLLM ranks them: the chosen token's counts every token at least as likely
    (read off the top ``k`` when it is above the last of them, else counted over the row), the top
    ones rank by position."""
    value, values, ids = float(raw_logprobs[token]), [], []
    if k:
        top = torch.topk(raw_logprobs, k)
        values, ids = top.values.tolist(), top.indices.tolist()
    rank = sum(v >= value for v in values) if values and value > values[-1] else _count_at_least(raw_logprobs, value)
    return [(token, value, rank), *zip(ids, values, range(1, k + 1))]


def _count_at_least(row: torch.Tensor, value: float) -> int:
    """How many entries of ``row`` are >= ``value``: through numpy on the CPU, where torch's
    compare and sum took 23 us for 32,000 entries against numpy's 4 us."""
    if row.device.type == "cpu":
        return int(np.count_nonzero(row.float().numpy() >= value))
    return int((row >= value).sum())


def repetition_penalty(row: torch.Tensor, token_ids: Sequence[int], penalty: float) -> None:
    """transformers' repetition penalty on one row of logits (or of beam search's log-probs), in
    place: the score of every token in ``token_ids`` (prompt and output) divided by ``penalty``
    where positive, multiplied where negative."""
    if penalty != 1.0 and token_ids:
        seen = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=row.device)
        picked = row[seen]
        row[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
