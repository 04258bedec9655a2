"""The request batcher: continuous batching on the paged KV cache.

One step flows one way; only the scheduler changes KV state (through ``KVCacheManager``)::

    Scheduler.schedule() ──SchedulerOutput──▶ ModelRunner.execute() ──logits──▶ OutputProcessor.process()
        ▲  (who runs, tokens, positions, slots,   (storage: grow, swaps, copies;       │ (tokens, beams, stops)
        │   block tables, copies, swaps)           one packed forward)                 │
        └──────────────── Scheduler.update_from_output() ◀──StepResult (forks, frees, finished)

``intake.py`` validates requests; ``llm_engine.py`` is the loop; the scheduler, runner and output
processor never call each other.
"""

from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import CompletionOutput, Logprob, RequestOutput
from hf_paged.engine.params import RequestOutputKind, SamplingParams

__all__ = ["CompletionOutput", "LLMEngine", "Logprob", "RequestOutput", "RequestOutputKind", "SamplingParams"]
