"""The models a server answers to (vLLM's ``OpenAIServingModels``): its base model, and the LoRA
adapters served over it (``hf-paged serve --enable-lora --lora-modules``), each a
:class:`~hf_paged.lora.LoRARequest` with an id of its own: 1, 2, ... in the order given, then the
next free one for each adapter loaded at runtime (an id is never used twice: the engine keys an
adapter's weights and its cached prefix blocks by it).

A request's ``model`` picks one: the base model's name (or none) runs without an adapter, an
adapter's name with it, and the answer's ``model`` echoes it; another name is a 404
``model_not_found`` naming the served ones. ``/v1/models`` lists the base model, then each adapter
(``root``: its folder, ``parent``: the base model), as vLLM does.

Runtime updates (vLLM's, behind its switch ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, or
``--allow-runtime-lora-updating``): loading reads and checks the adapter in the engine at once
(``LLMEngine.add_lora``, between steps, on the engine's thread or in its process), so a bad folder
or adapter is a 400 naming what is wrong, and so is a name already served (unless ``load_inplace``:
vLLM's reload, which here takes a fresh id, so that prefix blocks cached with the old weights are
never reused). Unloading takes the name off the list first, so no new request can name it, then
unloads it in the engine; a name not served is a 404, an adapter that requests in flight still use
a 400 (it stays served: unload it once they finish). vLLM drops the name at once and leaves the
weights loaded until evicted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import methodcaller
from typing import TYPE_CHECKING, Any

from hf_paged.lora import LoRARequest
from hf_paged.serve.engine_loop import EngineFailure
from hf_paged.serve.protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, invalid

if TYPE_CHECKING:
    from hf_paged.serve.engine_loop import EngineLoop

logger = logging.getLogger("hf_paged.serve")
RUNTIME_LORA_SWITCH = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's environment variable
ENGINE_CALL_TIMEOUT_S = 120.0  # reading an adapter waits for the step in progress, then for the disk
_MODULE_FIELDS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter served from the start (vLLM's): the name requests give as ``model``, its folder
    (peft's ``adapter_config.json`` and weights), and the served model it adapts (None: that one)."""

    name: str
    path: str
    base_model_name: str | None = None


def runtime_lora_updating(environ: dict | None = None) -> bool:
    """vLLM's switch for the load/unload routes: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` 1 or true."""
    environ = os.environ if environ is None else environ
    return environ.get(RUNTIME_LORA_SWITCH, "0").strip().lower() in ("1", "true")


def parse_lora_modules(items: Iterable[str]) -> list[LoRAModulePath]:
    """``--lora-modules`` items in vLLM's forms: ``name=path``, or JSON: an object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (or a list of them). ``ValueError``
    naming the item when one is neither."""
    modules = []
    for item in items:
        if item.lstrip().startswith(("{", "[")):
            modules += _json_modules(item)
            continue
        name, sep, path = item.partition("=")
        if not (sep and name.strip() and path.strip()):
            raise ValueError(f"--lora-modules {item!r}: expected name=path, or JSON "
                             '{"name": ..., "path": ..., "base_model_name": ...}')
        modules.append(LoRAModulePath(name.strip(), path.strip()))
    return modules


def _json_modules(item: str) -> list[LoRAModulePath]:
    try:
        value = json.loads(item)
    except json.JSONDecodeError as err:
        raise ValueError(f"--lora-modules {item!r}: not valid JSON ({err})") from None
    modules = []
    for entry in value if isinstance(value, list) else [value]:
        if not isinstance(entry, dict):
            raise ValueError(f"--lora-modules {item!r}: an adapter is a JSON object with "
                             f"{', '.join(_MODULE_FIELDS)}, got {json.dumps(entry)}")
        unknown = sorted(set(entry) - set(_MODULE_FIELDS))
        if unknown:
            raise ValueError(f"--lora-modules {item!r}: unknown field(s) {', '.join(unknown)} "
                             f"(an adapter has {', '.join(_MODULE_FIELDS)})")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f"--lora-modules {item!r}: name and path must be non-empty strings")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {item!r}: base_model_name must be a string")
        modules.append(LoRAModulePath(name, path, base))
    return modules


def lora_requests(modules: Sequence[LoRAModulePath], base_model_name: str) -> dict[str, LoRARequest]:
    """The adapters served from the start, by name: ids 1, 2, ... in order, each the base model's
    child. ``ValueError`` for a name given twice or the base model's own (a request's ``model``
    could not tell them apart), and for a ``base_model_name`` other than the served model's (this
    server has one base model; vLLM would quietly serve the adapter over it anyway)."""
    served: dict[str, LoRARequest] = {}
    for module in modules:
        if not isinstance(module, LoRAModulePath):
            raise ValueError(f"lora_modules holds LoRAModulePath items, got {type(module).__name__}")
        where = f"LoRA module {module.name!r} ({module.path})"
        if module.name in served or module.name == base_model_name:
            other = "the served model's name" if module.name == base_model_name else "another adapter's name too"
            raise ValueError(f"{where}: its name is {other}; requests pick an adapter by name")
        if module.base_model_name not in (None, base_model_name):
            raise ValueError(f"{where}: base_model_name {module.base_model_name!r} is not the served model "
                             f"{base_model_name!r}")
        served[module.name] = LoRARequest(module.name, len(served) + 1, module.path, base_model_name)
    return served


class OpenAIServingModels:
    """The base model and the adapters served now (see the module docstring). Lives on the
    server's event loop: the engine is reached through ``loop.call`` only. ``max_loras``: the
    engine's (None: it serves no adapters)."""

    def __init__(self, loop: EngineLoop, base_model_name: str, lora_modules: Sequence[LoRAModulePath] = (),
                 max_model_len: int | None = None, max_loras: int | None = None):
        if lora_modules and max_loras is None:
            raise ValueError("lora_modules: the engine serves no LoRA adapters; build it with enable_lora=True "
                             "(hf-paged serve --enable-lora)")
        self.loop, self.base_model_name, self.max_model_len = loop, base_model_name, max_model_len
        self.lora_enabled = max_loras is not None
        self.lora_requests = lora_requests(lora_modules, base_model_name)
        self._next_id = len(self.lora_requests) + 1
        self._updating = asyncio.Lock()  # one load or unload at a time

    # ------------------------------------------------------------------ which model a request names
    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names: None for the base model (or no name), a 404
        ``model_not_found`` naming the served models for another name."""
        if model is None or model == self.base_model_name:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            known = ", ".join(repr(name) for name in self.names())
            raise APIError(404, f"the model '{model}' does not exist (this server has {known})", param="model",
                           code="model_not_found")
        return lora

    def serves(self, lora: LoRARequest | None) -> bool:
        """Whether ``lora`` is still served (an unload may have come while its request was tokenized)."""
        return lora is None or self.lora_requests.get(lora.lora_name) is lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """What an answer's ``model`` says: the adapter's name, else the base model's."""
        return self.base_model_name if lora is None else lora.lora_name

    def names(self) -> list[str]:
        return [self.base_model_name, *self.lora_requests]

    # ------------------------------------------------------------------ /v1/models
    def cards(self) -> list[dict[str, Any]]:
        """vLLM's model cards: the base model's, then one per adapter."""
        base = {"id": self.base_model_name, "object": "model", "created": 0, "owned_by": "hf_paged",
                "root": self.base_model_name, "parent": None, "max_model_len": self.max_model_len}
        return [base, *({"id": lora.lora_name, "object": "model", "created": 0, "owned_by": "hf_paged",
                         "root": lora.lora_path, "parent": lora.base_model_name or self.base_model_name,
                         "max_model_len": self.max_model_len} for lora in self.lora_requests.values())]

    def card(self, model_id: str) -> dict[str, Any]:
        self.lora_request(model_id)  # a 404 for a model not served
        return next(card for card in self.cards() if card["id"] == model_id)

    # ------------------------------------------------------------------ runtime updates
    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        """Read and check the adapter in the engine now, then serve it under ``lora_name``; its answer
        is vLLM's. 400: a name served already (without ``load_inplace``) or the base model's, a bad
        folder or adapter (the engine's message names what is wrong); 503: the engine is gone."""
        self._check_enabled()
        async with self._updating:
            known = self.lora_requests.get(req.lora_name)
            if req.lora_name == self.base_model_name:
                raise invalid("lora_name", f"'{req.lora_name}' is the served model's name; give the adapter another")
            if known is not None and not req.load_inplace:
                raise invalid("lora_name", f"the LoRA adapter '{req.lora_name}' has already been loaded (send "
                                           "load_inplace: true to load it again)")
            lora = LoRARequest(req.lora_name, self._next_id, req.lora_path, self.base_model_name)
            self._next_id += 1  # used even if the load fails: the engine may hold it under that id already
            try:
                await self._engine_call(methodcaller("add_lora", lora))
            except APIError:
                raise
            except Exception as err:  # noqa: BLE001 - the engine's refusal: a 400, as vLLM answers any
                raise invalid("lora_path", f"the LoRA adapter '{req.lora_name}' cannot be loaded: {err}") from None
            self.lora_requests[req.lora_name] = lora  # a reload keeps its place in the list
            if known is not None:
                await self._release(known)
        logger.info("loaded LoRA adapter '%s' from %s (id %d)", req.lora_name, req.lora_path, lora.lora_int_id)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter and unload it from the engine; its answer is vLLM's. 404: not
        served; 400: requests in flight still use it (it stays served); 503: the engine is gone (the
        adapter is no longer served)."""
        self._check_enabled()
        async with self._updating:
            lora = self._served(req)
            served = dict(self.lora_requests)
            del self.lora_requests[lora.lora_name]  # no request from now on can name it
            try:
                await self._engine_call(methodcaller("remove_lora", lora.lora_int_id))
            except ValueError as err:  # in use by requests in flight
                self.lora_requests = served
                raise invalid("lora_name", f"the LoRA adapter '{lora.lora_name}' cannot be unloaded now: {err}") \
                    from None
        logger.info("unloaded LoRA adapter '%s'", lora.lora_name)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."

    def _check_enabled(self) -> None:
        if not self.lora_enabled:
            raise invalid(None, "this server serves no LoRA adapters (start it with --enable-lora)")

    def _served(self, req: UnloadLoRAAdapterRequest) -> LoRARequest:
        """The adapter an unload names (by ``lora_name``, ``lora_int_id`` or both, which must agree)."""
        if req.lora_name is None and req.lora_int_id is None:
            raise invalid("lora_name", "send the adapter's lora_name (or its lora_int_id)")
        found = [lora for lora in self.lora_requests.values()
                 if req.lora_name in (None, lora.lora_name) and req.lora_int_id in (None, lora.lora_int_id)]
        if not found:
            if req.lora_name is None:
                what = f"no LoRA adapter has lora_int_id {req.lora_int_id}"
            else:
                what = f"the LoRA adapter '{req.lora_name}' cannot be found"
                if req.lora_int_id is not None:
                    what += f" with lora_int_id {req.lora_int_id}"
            raise APIError(404, f"{what} (served: {', '.join(self.lora_requests) or 'none'})", param="lora_name",
                           code="model_not_found")
        return found[0]

    async def _release(self, lora: LoRARequest) -> None:
        """Unload a replaced adapter's weights unless requests in flight still use them (then the
        engine evicts them once they finish and ``max_cpu_loras`` says so)."""
        try:
            await self._engine_call(methodcaller("remove_lora", lora.lora_int_id))
        except ValueError:
            pass

    async def _engine_call(self, fn: Callable) -> Any:
        """``fn(engine)`` where the engine runs, between steps (``fn`` pickles: an engine process runs it
        too); a 503 when the engine is gone or does not answer in time."""
        future = self.loop.call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), ENGINE_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine did not answer within {ENGINE_CALL_TIMEOUT_S:.0f} s",
                           code="engine_unhealthy") from None
        except EngineFailure as err:
            raise APIError(503, str(err), code=err.code) from None
