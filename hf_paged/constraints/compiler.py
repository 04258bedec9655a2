"""Compiling constraints with xgrammar: per tokenizer, cached, off the caller's thread, bounded.

A :class:`ConstraintCompiler` belongs to one tokenizer and vocabulary width (the model's logits
width, which may exceed the tokenizer's). Compiled grammars are cached by the constraint's
``key`` (an LRU of ``cache_size``), and so are compile errors, so a bad schema sent again fails
at once. Compiles run on a small thread pool (xgrammar releases the GIL while it compiles), so
the engine thread keeps stepping while a request waits for its grammar; :meth:`submit` returns a
``Future``. Limits keep a pathological constraint from hanging or exhausting the process: sizes
are bounded before compiling (:mod:`hf_paged.constraints.params`, :mod:`.schema`), a compile
that takes longer than ``timeout_s`` fails the requests waiting for it (the compile itself cannot
be interrupted: it finishes on its worker, and its result is cached), and a compiled grammar
larger than ``max_grammar_bytes`` is refused.

Special tokens (``<s>``, ``<pad>``, chat markers) are given to xgrammar as tokens without text:
a grammar never allows them (except the stop tokens at the end), because the engine's text skips
them and an output that needed them would not read as it was matched.
"""

from __future__ import annotations

import copy
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from hf_paged.constraints.params import MAX_JSON_WHITESPACE, StructuredOutputsParams
from hf_paged.constraints.utf8 import Utf8Guard

DEFAULT_TIMEOUT_S = 10.0
MAX_GRAMMAR_BYTES = 64 * 2**20
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[06:19:07] /project/cpp/x.cc:83: "
_FAILED_CHECK = re.compile(r"^Check failed: .*? is false:\s*")  # "Check failed: (val <= MAX) is false: "


class ConstraintError(ValueError):
    """A constraint that cannot be used: invalid, too large, or too slow to compile. ``kind`` is
    the constraint's kind (``"json"``, ``"regex"``, ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def copy(self) -> ConstraintError:
        """The same error, never raised. The compiler caches a failed compile's error and raises a copy
        for each request: raising the cached one would chain every raise's traceback onto it, and
        with them the frames (requests, prompts) of every caller, for as long as it is cached."""
        return ConstraintError(self.kind, str(self))


def xgrammar():
    """The xgrammar module (imported on first use: a model that is never constrained never loads it)."""
    try:
        import xgrammar as xgr
    except ImportError as err:  # pragma: no cover - a dependency; only a broken install lacks it
        raise ConstraintError("", f"structured outputs need the xgrammar package ({err})") from None
    return xgr


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of ``tokenizer`` with ``vocab_size`` columns, special tokens without text."""
    xgr = xgrammar()
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            encoded[index] = token
    for index in _special_ids(tokenizer):
        if index < vocab_size:
            encoded[index] = ""
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids, add_prefix_space=detected.add_prefix_space)


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ids | {index for index, token in decoder.items() if getattr(token, "special", False)}


class ConstraintCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = 2, cache_size: int = 256,
                 max_grammar_bytes: int = MAX_GRAMMAR_BYTES):
        if not stop_token_ids:
            raise ValueError("a constraint compiler needs the model's stop (EOS) token ids")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self.timeout_s, self.cache_size, self.max_grammar_bytes = timeout_s, cache_size, max_grammar_bytes
        self._lock = threading.Lock()
        self._backend = None  # xgrammar.GrammarCompiler, built on the first compile (off the caller's thread)
        self._guard: Utf8Guard | None = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()  # key -> CompiledGrammar or ConstraintError
        self._pending: dict[tuple, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="hf-paged-grammar")
        self.stats = {"compiled": 0, "cache_hits": 0, "failed": 0, "compile_s": 0.0}

    def cached(self, params: StructuredOutputsParams):
        """The compiled grammar when it is ready now (a ``ConstraintError`` raises), else None."""
        with self._lock:
            found = self._cache.get(params.key)
            if found is not None:
                self._cache.move_to_end(params.key)
        if isinstance(found, ConstraintError):
            raise found.copy()
        return found

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once on a cache hit); it fails with
        ``ConstraintError``. One compile per key however many requests wait for it."""
        with self._lock:
            found = self._cache.get(params.key)
            if found is not None:
                self._cache.move_to_end(params.key)
                self.stats["cache_hits"] += 1
                return _done(found.copy() if isinstance(found, ConstraintError) else found)
            future = self._pending.get(params.key)
            if future is None or future.cancelled():
                future = self._pending[params.key] = self._pool.submit(self._compile_and_keep, params)
            return future

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None):
        """Compile (or find) ``params`` now, waiting at most ``timeout_s`` (default: the compiler's)."""
        return wait(self.submit(params), params, self.timeout_s if timeout_s is None else timeout_s)

    def _compile_and_keep(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        try:
            result = self._compile(params)
        except ConstraintError as err:
            result = err
        except Exception as err:  # noqa: BLE001 - xgrammar's own errors: a bad regex, grammar or schema
            result = ConstraintError(params.kind, f"invalid {params.kind}: {clean_error(err)}")
        if isinstance(result, ConstraintError):
            result = result.copy()  # the cache keeps one never raised (see ConstraintError.copy)
        with self._lock:
            self._pending.pop(params.key, None)
            self._cache[params.key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.stats["failed" if isinstance(result, ConstraintError) else "compiled"] += 1
            self.stats["compile_s"] += time.perf_counter() - start
        if isinstance(result, ConstraintError):
            raise result.copy()
        return result

    def _compile(self, params: StructuredOutputsParams):
        backend = self._compiler()
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            grammar = backend.compile_grammar(json_grammar(schema, params.disable_any_whitespace))
        elif kind == "regex":
            grammar = backend.compile_regex(params.regex)
        elif kind == "choice":
            options = [{"type": "const_string", "value": option} for option in params.choice]
            grammar = backend.compile_structural_tag({"type": "structural_tag",
                                                      "format": {"type": "or", "elements": options}})
        elif kind == "grammar":
            grammar = backend.compile_lark(params.grammar) if params.is_lark else backend.compile_grammar(params.grammar)
        else:
            grammar = backend.compile_structural_tag(structural_tag(params.structural_tag))
        size = grammar.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise ConstraintError(kind, f"the compiled {kind} grammar takes {size / 2**20:.1f} MiB, over the "
                                        f"limit of {self.max_grammar_bytes / 2**20:.0f} MiB")
        return grammar

    def _compiler(self):
        with self._lock:
            if self._backend is None:
                xgr = xgrammar()
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                self._backend = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                width = xgr.get_bitmask_shape(1, self.vocab_size)[1]
                self._guard = Utf8Guard(list(info.decoded_vocab), width)
            return self._backend

    @property
    def guard(self) -> Utf8Guard:
        """What a filled bitmask must still clear (valid only once something compiled)."""
        if self._guard is None:
            self._compiler()
        return self._guard

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait(future: Future, params: StructuredOutputsParams, timeout_s: float):
    """The future's grammar, or ``ConstraintError`` when it does not come within ``timeout_s``."""
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        raise too_slow(params, timeout_s) from None


def too_slow(params: StructuredOutputsParams, timeout_s: float) -> ConstraintError:
    return ConstraintError(params.kind, f"the {params.kind} constraint did not compile within {timeout_s:g} s "
                                        "(simplify it)")


def _done(result) -> Future:
    future: Future = Future()
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
    return future


def clean_error(err: Exception) -> str:
    """xgrammar's message without its timestamp, C++ source location and failed-check condition
    (what a 400 says: the C++ internals mean nothing to a client)."""
    lines = [_FAILED_CHECK.sub("", _XGRAMMAR_PREFIX.sub("", line)).strip() for line in str(err).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(err).__name__


_LOOSE_CHARACTERS = r'[^\"\\\r\n]'  # what xgrammar 0.2.8 writes for a length-bounded string's characters
_JSON_CHARACTERS = r'[^\0-\x1f\"\\]'  # what a JSON string may hold unescaped


def json_grammar(schema: dict, compact: bool = True) -> str:
    """The EBNF grammar of a JSON schema (xgrammar's conversion, strict mode), fixed up.

    ``compact``: one space after ``:`` and ``,``, none elsewhere; else up to
    ``MAX_JSON_WHITESPACE`` whitespace characters between tokens. xgrammar 0.2.8 matches a string
    with ``minLength``/``maxLength`` as any characters but ``"``, ``\\`` and newlines: raw control
    characters (a tab, U+0001) pass, which is not valid JSON. Its grammar text is rewritten to
    exclude them (a ``pattern`` would too, but bounded repetitions of a regex compile slowly:
    0.6 s for ``{0,1000}``, while the grammar's own repetition is bounded at no cost)."""
    grammar = xgrammar().Grammar.from_json_schema(schema, any_whitespace=not compact, strict_mode=True,
                                                  max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
    return split_escape_runs(str(grammar).replace(_LOOSE_CHARACTERS, _JSON_CHARACTERS))


_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}  # how many hex digits xgrammar prints after each escape
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def split_escape_runs(ebnf: str) -> str:
    """xgrammar's grammar text with each string literal split after an escaped character that a
    hex digit follows: xgrammar 0.2.9 prints a ``const`` or ``enum`` string ``"éA"`` as the literal
    ``"\\xe9A"``, and its parser reads every hex digit after ``\\x`` into the escape: U+0E9A, so
    the grammar read back from the text allowed "ບ" and refused "éA". ``"\\xe9" "A"`` is the same
    sequence, read right (``\\u`` and ``\\U`` escapes, read right today, are split too).
    Character classes are left as they are."""
    out, i, inside, in_class = [], 0, False, False
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "\\":
            width = _ESCAPE_DIGITS.get(ebnf[i + 1: i + 2], 0)
            end = i + 2 + width
            out.append(ebnf[i:end])
            i = end
            if width and inside and i < len(ebnf) and ebnf[i] in _HEX_DIGITS:
                out.append('" "')
            continue
        if ch == '"' and not in_class:
            inside = not inside
        elif ch == "[" and not inside:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


def structural_tag(tag: dict) -> dict:
    """A structural tag as xgrammar takes it (a bare format is wrapped), embedded JSON schemas (of
    the plain ``json`` style) turned into grammars by :func:`json_grammar`, with bounded whitespace."""
    tag = copy.deepcopy(tag if "format" in tag else {"type": "structural_tag", "format": tag})
    stack = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if (node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict)
                    and node.get("style", "json") == "json"):
                schema = node["json_schema"]
                node.clear()
                node.update(type="grammar", grammar=json_grammar(schema, compact=False))
                continue
            stack += list(node.values())
        elif isinstance(node, list):
            stack += node
    return tag


_registry: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int | None = None, stop_token_ids: list[int] | None = None,
                 **options) -> ConstraintCompiler:
    """The shared compiler (and cache) of ``tokenizer`` at this vocabulary width and stop tokens."""
    vocab_size = vocab_size or len(tokenizer)
    if stop_token_ids is None:
        stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    key = (vocab_size, tuple(stop_token_ids), tuple(sorted(options.items())))
    with _registry_lock:
        per_tokenizer = _registry.setdefault(tokenizer, {})
        if key not in per_tokenizer:
            per_tokenizer[key] = ConstraintCompiler(tokenizer, vocab_size, list(stop_token_ids), **options)
        return per_tokenizer[key]
