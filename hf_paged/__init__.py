"""hf_paged: PagedAttention (vLLM, SOSP 2023) for Hugging Face transformers.

``import hf_paged`` registers the ``"hf_paged"`` attention and mask functions; ``enable(model)``
adds the ``cache_implementation="hf_paged"`` flag to that model's ``generate``.
"""

from hf_paged.async_llm import AsyncLLM, AsyncLLMEngine
from hf_paged.attention import ATTN_IMPLEMENTATION, PagedMask, set_kernel_mode
from hf_paged.block_manager import BlockManager, BlockManagerError, NoFreeBlocksError, UnknownSequenceError
from hf_paged.cache import PagedKVCache
from hf_paged.constraints import StructuredOutputsParams
from hf_paged.engine import CompletionOutput, LLMEngine, Logprob, RequestOutput, RequestOutputKind, SamplingParams
from hf_paged.generate import CACHE_IMPLEMENTATION, disable, enable, prefix_cache
from hf_paged.llm import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from hf_paged.pipeline import PagedTextGenerationPipeline, pipeline
from hf_paged.prefix_cache import PrefixCache
from hf_paged.prefix_snapshot import SnapshotError

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CACHE_IMPLEMENTATION",
    "BlockManager",
    "BlockManagerError",
    "CompletionOutput",
    "LLM",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "SnapshotError",
    "StructuredOutputsParams",
    "NoFreeBlocksError",
    "PagedKVCache",
    "PagedMask",
    "PagedTextGenerationPipeline",
    "PrefixCache",
    "UnknownSequenceError",
    "disable",
    "enable",
    "pipeline",
    "prefix_cache",
    "set_kernel_mode",
]
__version__ = "0.1.0"
