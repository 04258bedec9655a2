"""The built-in demo model and byte-level tokenizer, built from code (nothing is downloaded).

``demo_model()`` loads the weights shipped in the package (``data/demo_model.safetensors``: the
model trained for a few CPU minutes on Python's standard-library docstrings by
``python -m hf_paged.train_demo``), so its text is readable, if simple. ``demo_model(trained=False)``,
or any change of shape, gives seeded random weights instead (what tests use: gibberish text, and
memory and token-exactness do not depend on training).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
DEMO_WEIGHTS = Path(__file__).parent / "data" / "demo_model.safetensors"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per UTF-8 byte, plus <pad>, <s>, </s> (ids 0, 1, 2)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )
    tokenizer.chat_template = (  # tools and tool calls in the Hermes syntax (hf_paged.serve.tools)
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
        "{% for c in m['tool_calls'] or [] %}<tool_call>\n{{ {'name': c['function']['name'], "
        "'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def demo_config(**overrides) -> LlamaConfig:
    """A small Llama-shaped config (GQA, RoPE) sized for a 2-core CPU."""
    options = dict(
        vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.05,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )
    options.update(overrides)
    return LlamaConfig(**options)


def demo_model(seed: int = 0, dtype: torch.dtype = torch.float32, trained: bool | None = None,
               **overrides) -> LlamaForCausalLM:
    """The built-in tiny model, in eval mode: the shipped trained weights (``trained=None``: when
    the shape is the default one and the file is there), else seeded random weights."""
    if trained is None:
        trained = not overrides and DEMO_WEIGHTS.exists()
        if not overrides and not trained:  # an install without its data files: say so, not just babble
            warnings.warn(f"{DEMO_WEIGHTS} is missing: the demo model has random weights "
                          "(python -m hf_paged.train_demo writes them)", stacklevel=2)
    if trained and overrides:
        raise ValueError(f"the trained demo weights have the default shape; {sorted(overrides)} change it")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(demo_config(**overrides))
    if trained:
        from safetensors.torch import load_file

        missing, unexpected = model.load_state_dict(load_file(str(DEMO_WEIGHTS)), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"{DEMO_WEIGHTS} does not fit the demo config (missing {missing}, unexpected {unexpected})")
        model.tie_weights()
    model = model.to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    model.hf_paged_demo = "trained" if trained else "random"  # what describe_model() reports
    return model


def describe_model(model) -> str:
    """Which built-in model this is, for the command line's output."""
    kind = getattr(model, "hf_paged_demo", None)
    if kind == "trained":
        return "the built-in demo model (trained briefly on Python's docstrings: simple text)"
    if kind == "random":
        return "the built-in demo model with random weights (its text is gibberish)"
    return type(model).__name__
