"""The request batcher: continuous batching on the paged KV cache."""

from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.params import SamplingParams

__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
