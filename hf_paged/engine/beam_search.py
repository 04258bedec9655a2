"""Beam-search decisions for one request, reproducing ``transformers``' beam search exactly.

The engine keeps every beam as a sequence with its own block table; this module only decides.
It receives the next-token log-probabilities of the running beams and answers which
``(parent beam, token)`` continuations run next, which hypotheses are finished, when the request
is done, and the ranked outputs. No model, no cache: tensors in, decisions out.

The arithmetic follows ``GenerationMixin._beam_search`` (transformers 5.17 - 5.24, which agree)
for a batch of one prompt, with the same float32 tensor operations in the same order, so that
both the chosen sequences and ``sequences_scores`` come out bit-identical when the log-probs are:

* accumulated scores are ``log_probs + running_score`` over a flattened ``num_beams * vocab`` row,
  of which the top ``K = max(2, 1 + len(eos)) * num_beams`` are candidates (``torch.topk``);
* the initial running scores are ``[0, -1e9, ...]``, so the first step only expands beam 0;
* a candidate is finished when its token is an EOS id or when it reaches ``max_new_tokens``;
  finished candidates get ``-1e9`` added and the best ``num_beams`` of the rest keep running;
* only finished candidates ranked among the first ``num_beams`` of the ``K`` may enter the pool
  of finished hypotheses, with score ``sum_logprob / generated_len ** length_penalty`` where
  ``generated_len`` counts the new tokens including the final one (EOS included);
* the pool keeps the best ``num_beams``; it is closed (``-1e9``) once full under
  ``early_stopping=True`` or once the early-stop heuristic says no running beam can improve it;
* the search ends when the heuristic says so, when the pool is full and ``early_stopping`` is
  ``True``, or when every candidate hit a stopping condition (the length limit).

``min_new_tokens`` is applied inside :meth:`BeamSearchState.step` (as transformers does, on the
log-probs after log-softmax: EOS entries become ``-inf`` while fewer than ``min_new_tokens``
tokens have been generated), so the engine passes the plain ``log_softmax(logits.float())``.
"""

from __future__ import annotations

import math

import torch

from hf_paged.model_info import token_id_list

__all__ = ["BeamSearchState", "apply_min_new_tokens", "candidate_count", "generate_fill_token"]

_NEG = -1.0e9  # transformers' "impossible" score: added, never assigned (except the initial values)


def candidate_count(num_beams: int, num_eos: int) -> int:
    """How many candidates a step keeps: enough that ``num_beams`` unfinished ones always remain."""
    return max(2, 1 + num_eos) * num_beams


def generate_fill_token(pad_token_id: int | None, eos_token_ids: list[int]) -> int:
    """The token transformers' beam search writes after a hypothesis' end in ``sequences``.

    It is ``pad_token_id or eos_token_ids[0]``: a pad id of ``0`` (falsy) or ``None`` gives the
    first EOS id instead; with no EOS ids at all, ``-1`` (never visible: every hypothesis then
    has the full length).
    """
    if not eos_token_ids:
        return -1
    return pad_token_id or eos_token_ids[0]


def apply_min_new_tokens(
    log_probs: torch.Tensor, generated_len: int, min_new_tokens: int, eos_token_ids: list[int]
) -> torch.Tensor:
    """EOS log-probs set to ``-inf`` while fewer than ``min_new_tokens`` tokens were generated.

    Returns a new tensor when it masks, the input itself otherwise. :meth:`BeamSearchState.step`
    already calls this; it is exposed for callers that want the processed log-probs themselves
    (e.g. to report per-step ``scores`` as transformers does).
    """
    vocab = log_probs.shape[-1]
    stops = [t for t in eos_token_ids if t < vocab]  # an id past the vocabulary is never chosen: nothing to mask
    if generated_len >= min_new_tokens or not stops:
        return log_probs
    blocked = torch.zeros(vocab, dtype=torch.bool, device=log_probs.device)
    blocked[torch.tensor(stops, device=log_probs.device)] = True
    return torch.where(blocked, -math.inf, log_probs)


class BeamSearchState:
    """The beam-search state of one request (one prompt).

    Usage: call :meth:`step` with the log-softmax of each running beam's last-position logits
    (rows in the order of :attr:`running`) until it returns ``[]`` (then :attr:`done` is true),
    then :meth:`finalize`.
    """

    def __init__(
        self,
        *,
        num_beams: int,
        num_return_sequences: int,
        length_penalty: float,
        early_stopping: bool | str,
        eos_token_ids: list[int],
        prompt_len: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
    ):
        if num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {num_beams}")
        if not 1 <= num_return_sequences <= num_beams:
            raise ValueError(f"num_return_sequences must be in [1, num_beams={num_beams}], got {num_return_sequences}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")

        self.num_beams = num_beams
        self.num_return_sequences = num_return_sequences
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = token_id_list(eos_token_ids)
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.num_candidates = candidate_count(num_beams, len(self.eos_token_ids))

        # Number of tokens every running beam has generated so far (transformers' cur_len - prompt_len).
        self.generated_len = 0
        self._running: list[list[int]] = [[] for _ in range(num_beams)]
        self._device: torch.device | None = None
        # Tensors with a leading batch dimension of one, the shapes transformers uses, so that
        # topk sees identical inputs (ties resolve the same way).
        self._running_scores = torch.full((1, num_beams), _NEG, dtype=torch.float32)
        self._running_scores[:, 0] = 0.0
        self._pool_scores = torch.full((1, num_beams), _NEG, dtype=torch.float32)
        self._pool_finished = torch.zeros((1, num_beams), dtype=torch.bool)
        self._pool_tokens: list[list[int]] = [[] for _ in range(num_beams)]
        self._can_improve = torch.ones((1, 1), dtype=torch.bool)
        self._top_mask = torch.zeros((1, self.num_candidates), dtype=torch.bool)
        self._top_mask[:, :num_beams] = True
        # an id past int64 can never be chosen: -1 stands in for it (it keeps its place in the count above)
        self._eos = torch.tensor([t if t < 2**63 else -1 for t in self.eos_token_ids], dtype=torch.long)
        self._done = False

    # ------------------------------------------------------------------ views

    @property
    def done(self) -> bool:
        """True once the search has ended (the last :meth:`step` returned ``[]``)."""
        return self._done

    @property
    def running(self) -> list[list[int]]:
        """Generated token ids (no prompt) of each running beam, in row order; ``[]`` once done."""
        if self._done:
            return []
        return [list(tokens) for tokens in self._running]

    @property
    def running_scores(self) -> list[float]:
        """Accumulated log-probability of each running beam (``-1e9`` for placeholder beams)."""
        return self._running_scores[0].tolist()

    def finished_hypotheses(self) -> list[tuple[list[int], float]]:
        """The current pool of finished hypotheses, best first (at most ``num_beams``)."""
        flags = self._pool_finished[0].tolist()
        scores = self._pool_scores[0].tolist()
        return [(list(t), s) for t, s, f in zip(self._pool_tokens, scores, flags) if f]

    # ------------------------------------------------------------------ the search

    def _to(self, device: torch.device) -> None:
        if self._device == device:
            return
        self._device = device
        for name in ("_running_scores", "_pool_scores", "_pool_finished", "_can_improve", "_top_mask", "_eos"):
            setattr(self, name, getattr(self, name).to(device))

    def step(self, log_probs: torch.Tensor) -> list[tuple[int, int]]:
        """Advance one token.

        ``log_probs``: float32 ``(num_beams, vocab)``, row ``i`` the log-softmax of the logits that
        follow running beam ``i`` (:attr:`running` order). At the first step all beams are the
        bare prompt: pass the prompt's row ``num_beams`` times, or once (shape ``(1, vocab)``).
        Do not apply ``min_new_tokens`` beforehand (harmless if done: the masking is idempotent).

        Returns the next running beams as ``(parent_row, token)``: row ``j`` of the next call is
        running beam ``parent_row`` with ``token`` appended. Several rows may share a parent, and
        a parent may have none (its sequence can be dropped). ``[]`` when the search is done.
        A returned token is never an EOS id (as long as the vocabulary has more than
        ``len(eos_token_ids)`` tokens); beams that end go to the finished pool, not to the engine.

        The tensor work runs on ``log_probs``' device, as transformers' does (same kernels, so
        the same rounding, e.g. CUDA divides by a scalar through its reciprocal); it costs a
        few small kernels and host syncs per step.
        """
        if self._done:
            raise RuntimeError("beam search is already done")
        if log_probs.dim() != 2:
            raise ValueError(f"log_probs must be 2-D (beams, vocab), got shape {tuple(log_probs.shape)}")
        num_beams = self.num_beams
        if log_probs.shape[0] != num_beams:
            if self.generated_len == 0 and log_probs.shape[0] == 1:
                log_probs = log_probs.expand(num_beams, -1)
            else:
                raise ValueError(f"expected {num_beams} rows of log-probs, got {log_probs.shape[0]}")
        if log_probs.dtype != torch.float32:
            raise ValueError(f"log_probs must be float32 (as transformers computes them), got {log_probs.dtype}")
        self._to(log_probs.device)

        log_probs = apply_min_new_tokens(log_probs, self.generated_len, self.min_new_tokens, self.eos_token_ids)
        vocab = log_probs.shape[-1]

        # a. Candidates: the best K accumulated scores over all beams and tokens.
        accumulated = log_probs.reshape(1, num_beams, vocab) + self._running_scores[:, :, None]
        accumulated = accumulated.reshape(1, num_beams * vocab)
        cand_scores, cand_flat = torch.topk(accumulated, k=self.num_candidates)
        cand_parent = cand_flat // vocab
        cand_token = cand_flat % vocab

        # b. Which candidates stop: an EOS token, or the length limit (then all of them do).
        new_len = self.generated_len + 1
        if self.eos_token_ids:
            stops = torch.isin(cand_token, self._eos)
        else:
            stops = torch.zeros_like(cand_token, dtype=torch.bool)
        if new_len >= self.max_new_tokens:
            stops = torch.ones_like(stops)

        # c. Next running beams: the best num_beams candidates, stopped ones pushed to the bottom.
        run_scores = cand_scores + stops.to(torch.float32) * _NEG
        keep = torch.topk(run_scores, k=num_beams)[1]
        next_running_scores = torch.gather(run_scores, 1, keep)

        # d. Finished pool: merge in the stopped candidates among the first num_beams, with the
        #    length penalty, unless the pool is closed.
        entering = stops & self._top_mask
        penalised = cand_scores / (new_len**self.length_penalty)
        pool_full = torch.all(self._pool_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        penalised += pool_full.to(torch.float32) * _NEG
        penalised += (~self._can_improve).to(torch.float32) * _NEG
        penalised += (~entering) * _NEG
        merged_scores = torch.cat((self._pool_scores, penalised), dim=1)
        merged_finished = torch.cat((self._pool_finished, entering), dim=1)
        best = torch.topk(merged_scores, k=num_beams)[1]
        self._pool_scores = torch.gather(merged_scores, 1, best)
        self._pool_finished = torch.gather(merged_finished, 1, best)

        # Token bookkeeping on the host (small lists).
        parents = cand_parent[0].tolist()
        tokens = cand_token[0].tolist()
        cand_seqs = [self._running[p] + [t] for p, t in zip(parents, tokens)]
        old_pool = self._pool_tokens
        self._pool_tokens = [
            list(old_pool[i]) if i < num_beams else cand_seqs[i - num_beams] for i in best[0].tolist()
        ]
        keep_list = keep[0].tolist()
        self._running = [cand_seqs[i] for i in keep_list]
        self._running_scores = next_running_scores
        self.generated_len = new_len

        # e. Can a running beam still beat the worst finished hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = new_len
        best_possible = self._running_scores[:, :1] / (best_len**self.length_penalty)
        worst_finished = torch.where(
            self._pool_finished, torch.min(self._pool_scores, dim=1, keepdim=True)[0], _NEG
        )
        self._can_improve = self._can_improve & torch.any(best_possible > worst_finished, dim=-1, keepdim=True)

        # f. Stop when nothing can improve, the pool is full under early_stopping=True, or every
        #    candidate stopped (the length limit).
        pool_complete = bool(torch.all(self._pool_finished)) and self.early_stopping is True
        if not bool(torch.any(self._can_improve)) or pool_complete or bool(torch.all(stops)):
            self._done = True
            return []
        return [(parents[i], tokens[i]) for i in keep_list]

    def finalize(self) -> list[tuple[list[int], float]]:
        """The ``num_return_sequences`` best hypotheses, best first.

        Each is ``(generated token ids without the prompt, ending with the EOS token if it stopped
        on one, unpadded; score)`` with ``score`` equal to transformers' ``sequences_scores``.
        """
        if not self._done:
            raise RuntimeError("finalize() before the search is done")
        scores = self._pool_scores[0, : self.num_return_sequences].tolist()
        return [(list(self._pool_tokens[i]), scores[i]) for i in range(self.num_return_sequences)]

    def sequences_for_output(
        self, prompt_ids: list[int], pad_token_id: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sequences, sequences_scores)`` as ``generate`` returns them for this prompt.

        ``sequences``: int64 ``(num_return_sequences, prompt_len + longest returned hypothesis)``,
        prompt included, shorter hypotheses filled with :func:`generate_fill_token`;
        ``sequences_scores``: float32 ``(num_return_sequences,)``. On CPU.
        """
        if len(prompt_ids) != self.prompt_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, the state was built for {self.prompt_len}")
        best = self.finalize()
        width = self.prompt_len + max(len(tokens) for tokens, _ in best)
        fill = generate_fill_token(pad_token_id, self.eos_token_ids)
        sequences = torch.full((len(best), width), fill, dtype=torch.long)
        for row, (tokens, _) in enumerate(best):
            sequences[row, : self.prompt_len + len(tokens)] = torch.tensor(list(prompt_ids) + tokens, dtype=torch.long)
        scores = self._pool_scores[0, : self.num_return_sequences].detach().to("cpu", copy=True)
        return sequences, scores
