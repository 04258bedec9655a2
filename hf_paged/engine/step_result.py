"""``StepResult``: what the output processor made of a step's logits, for the scheduler to apply.

The output processor samples tokens, advances beams and decides which sequences and requests
are done, but never touches KV memory: each consequence for the blocks is a typed update here,
in the order it was decided, and :meth:`Scheduler.update_from_output` alone applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.engine.sequence import Request, Sequence


@dataclass(frozen=True)
class ForkSequence:
    """``child`` starts as a copy of ``parent`` and shares its blocks (a sample or a beam)."""

    parent: Sequence
    child: Sequence


@dataclass(frozen=True)
class FreeSequence:
    """``seq`` is done with its blocks (it finished, or its beam was not continued)."""

    seq: Sequence


@dataclass(frozen=True)
class FinishRequest:
    """``request`` is done (finished, failed or aborted): out of every queue, every block back."""

    request: Request


BlockUpdate = ForkSequence | FreeSequence | FinishRequest


@dataclass(frozen=True)
class StepResult:
    updates: tuple[BlockUpdate, ...] = ()  # in the order they were decided
    changed: tuple[Request, ...] = ()  # requests with new output this step, in step order
    num_generated_tokens: int = 0
    # requests that failed while their step was processed: their blocks may hold what made them
    # fail (e.g. NaN K/V), so none of them enters the prefix cache
    failed: frozenset[str] = frozenset()
    # every logits row of the step was non-finite: the model itself is failing (a failed step)
    all_logits_nonfinite: bool = False
    num_drafts: int = 0  # speculative decoding: sequences that computed a draft
    num_draft_tokens: int = 0  # and their draft tokens
    num_accepted_tokens: int = 0  # and those taken (each equal to the token chosen at its position)

    @property
    def finished(self) -> tuple[Request, ...]:
        return tuple(u.request for u in self.updates if isinstance(u, FinishRequest))
