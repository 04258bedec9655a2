"""Constrained decoding: JSON schemas, regexes, grammars and choices, enforced with xgrammar.

The same :class:`StructuredOutputsParams` constrains an ``LLMEngine`` request
(``SamplingParams(structured_outputs=...)``), a server request (``response_format``,
``structured_outputs``, tools) and ``model.generate()``, through the processors below::

    processor = hf_paged.constraints.json_schema(tokenizer, {"type": "object", ...})
    model.generate(**enc, logits_processor=[processor], cache_implementation="hf_paged")
"""

from __future__ import annotations

from typing import Any

from hf_paged.constraints.compiler import ConstraintCompiler, ConstraintError, compiler_for
from hf_paged.constraints.logits_process import StructuredLogitsProcessor
from hf_paged.constraints.params import (
    MAX_CHOICES, MAX_CONSTRAINT_BYTES, MAX_STRUCTURAL_TAG_BYTES, StructuredOutputsParams,
)
from hf_paged.constraints.schema import UnsupportedSchemaError, check_schema

__all__ = ["ConstraintCompiler", "ConstraintError", "MAX_CHOICES", "MAX_CONSTRAINT_BYTES", "MAX_STRUCTURAL_TAG_BYTES",
           "StructuredLogitsProcessor", "StructuredOutputsParams", "UnsupportedSchemaError", "check_schema", "choice",
           "compiler_for", "grammar", "json_object", "json_schema", "logits_processor", "regex"]


def logits_processor(tokenizer: Any, params: StructuredOutputsParams, *, vocab_size: int | None = None,
                     eos_token_id: int | list[int] | None = None) -> StructuredLogitsProcessor:
    """A ``generate()`` logits processor for ``params``. ``vocab_size``: the model's logits width
    (found from the scores when omitted); ``eos_token_id``: the ids that end the output (default:
    the tokenizer's EOS)."""
    return StructuredLogitsProcessor(tokenizer, params, vocab_size=vocab_size, eos_token_id=eos_token_id)


def json_schema(tokenizer: Any, schema: dict | str, *, disable_any_whitespace: bool = True,
                **options) -> StructuredLogitsProcessor:
    """Outputs that validate against ``schema`` (a dict, JSON text, or a pydantic model class)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=disable_any_whitespace)
    return logits_processor(tokenizer, params, **options)


def json_object(tokenizer: Any, *, disable_any_whitespace: bool = True, **options) -> StructuredLogitsProcessor:
    """Outputs that are one JSON object."""
    params = StructuredOutputsParams(json_object=True, disable_any_whitespace=disable_any_whitespace)
    return logits_processor(tokenizer, params, **options)


def regex(tokenizer: Any, pattern: str, **options) -> StructuredLogitsProcessor:
    """Outputs that match ``pattern`` as a whole."""
    return logits_processor(tokenizer, StructuredOutputsParams(regex=pattern), **options)


def choice(tokenizer: Any, options: list[str], **kwargs) -> StructuredLogitsProcessor:
    """Outputs that are exactly one of ``options``."""
    return logits_processor(tokenizer, StructuredOutputsParams(choice=options), **kwargs)


def grammar(tokenizer: Any, text: str, **options) -> StructuredLogitsProcessor:
    """Outputs of an EBNF grammar (rule ``root``), or a Lark one (rule ``start``, no ``::=``)."""
    return logits_processor(tokenizer, StructuredOutputsParams(grammar=text), **options)
