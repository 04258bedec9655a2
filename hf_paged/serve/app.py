"""The FastAPI app: OpenAI routes over one :class:`EngineLoop`, errors in OpenAI's shape.

Handlers parse and check a request, tokenize it (on worker threads with their own copies of the
tokenizer: the event loop never tokenizes, the engine thread uses the engine's), queue it on the
engine loop and read its outputs; a client that disconnects aborts its requests at once, and a
stream whose client reads nothing for ``stream_timeout_s`` is aborted (:mod:`.streaming`).
Statuses: 400 bad parameter (named), 401 bad key, 404 unknown model or route, 405 wrong method
(with ``Allow``), 413 body too large, 400 malformed JSON (as OpenAI), 503 with its cause in ``code``:
``server_overloaded`` (the waiting queue is full), ``server_shutting_down`` (:mod:`.shutdown`),
``engine_unhealthy`` (steps keep failing; ``/health`` says 503 too) or ``engine_error`` (the
engine failed this request's step). The POST routes publish their request models in
``/openapi.json``. A request's constraint (structured outputs, a forced tool call) is compiled
before the request is queued, so that a bad one is a 400 even for a stream; chat choices with
tools are parsed for tool calls (:mod:`.tools`), streamed as tool-call deltas. A request's ``model``
names the base model or one of the LoRA adapters served over it (:mod:`.serving_models`: which
adapters, ``/v1/models``, and vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or the settings allow them); its engine requests run with
that adapter and the answer's ``model`` echoes the name.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

import hf_paged
from hf_paged.constraints.compiler import ConstraintError, too_slow
from hf_paged.engine.detokenize import TextStream
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import FAULT, RequestOutput
from hf_paged.engine.params import SamplingParams
from hf_paged.lora import LoRARequest
from hf_paged.serve import responses, responses_api
from hf_paged.serve.engine_loop import (EngineFailure, EngineLoop, Overloaded, ProcessEngineLoop, RequestStream,
                                        shutting_down)
from hf_paged.serve.engine_process import EngineFacts, EngineProcess
from hf_paged.serve import tools as tool_calling
from hf_paged.serve.metrics import engine_stats
from hf_paged.serve.protocol import (APIError, ChatCompletionRequest, ChatTemplateFields, CompletionRequest,
                                     DetokenizeRequest, Limits, LoadLoRAAdapterRequest, TokenizeChatRequest,
                                     TokenizeCompletionRequest, UnloadLoRAAdapterRequest, decode_body, invalid, parse,
                                     resolve_max_tokens)
from hf_paged.serve.serving_models import LoRAModulePath, OpenAIServingModels, lora_requests, runtime_lora_updating
from hf_paged.serve.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, Ticket
from hf_paged.serve.streaming import BoundedStreamingResponse
from hf_paged.serve.tokenizer_pool import TokenizerPool
from hf_paged.serve.tools import HermesToolParser, parse_tool_calls

logger = logging.getLogger("hf_paged.serve")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
GENERATION_CONFIG_MODES = ("auto", "vllm")  # --generation-config


@dataclass(frozen=True)
class ServerSettings:
    """What the command line sets (the engine's own options go to ``LLMEngine``)."""

    model_name: str = "hf-paged-demo"
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_waiting: int | None = 512
    max_n: int = 16
    max_tokens: int = 4096
    max_logprobs: int = 20  # the most top log-probs a request may ask for; -1: the whole vocabulary (vLLM's)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # in-flight requests' time to finish at shutdown
    stream_timeout_s: float = 60.0  # a stream whose client reads nothing this long is aborted
    # "auto": the model's generation_config.json values (temperature, top_p, top_k, min_p,
    # repetition_penalty, max_new_tokens) are the defaults of requests that set none; "vllm": not
    generation_config: str = "auto"
    chat_template: str | None = None  # Jinja text used instead of the tokenizer's (--chat-template)
    trust_request_chat_template: bool = False  # whether a request may send its own chat_template
    # LoRA adapters served from the start (--lora-modules; the engine needs enable_lora=True): requests
    # name them as their model; ids 1, 2, ... in this order
    lora_modules: tuple[LoRAModulePath, ...] = ()
    # vLLM's runtime loading routes (/v1/load_lora_adapter, /v1/unload_lora_adapter); also on where the
    # environment has VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or true), as vLLM
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        """A value the command line would refuse is refused here too: any other one (a typo, "Auto")
        would quietly serve as "vllm" and drop the model's defaults; adapters named twice, or as the
        model, could not be told apart."""
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        try:
            lora_requests(self.lora_modules, self.model_name)
        except ValueError as err:
            raise ValueError(f"ServerSettings.lora_modules: {err}") from None
        if self.max_logprobs < -1:
            raise ValueError(f"ServerSettings.max_logprobs must be >= 0, or -1 (the vocabulary), "
                             f"got {self.max_logprobs}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"ServerSettings.generation_config must be one of "
                             f"{', '.join(map(repr, GENERATION_CONFIG_MODES))}, got {self.generation_config!r}")


@dataclass
class _Job:
    """One HTTP generation request on its way through the engine."""

    kind: str  # "completion" | "chat"
    response_id: str
    request: CompletionRequest | ChatCompletionRequest
    prompt_texts: list[str]  # echo: the text each choice starts with, per prompt (chat: the last message's)
    ticket: Ticket
    echoed_ids: list[bool] = field(default_factory=list)  # per echoed prompt: given as token ids (decoded whole)
    stream: RequestStream | None = None
    model: str = ""  # what the answer's model says: the base model's name or the adapter's
    lora: LoRARequest | None = None  # the adapter its engine requests run with (None: the base model)
    tools: bool = False  # chat with tools: <tool_call> blocks become tool_calls (serve/tools.py)
    calls_only: bool = False  # tool_choice "required" or named: the output is calls only
    parsers: dict[int, HermesToolParser] | None = None  # streaming with tools: a parser per choice
    view: responses_api.ResponseRenderer | None = None  # /v1/responses: answers this chat job as a Response

    def tool_parser(self, index: int) -> HermesToolParser:
        if self.parsers is None:
            self.parsers = {}
        return self.parsers.setdefault(index, HermesToolParser(self.calls_only))

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def echoes_logprobs(self) -> bool:
        """Completions' ``echo`` with ``logprobs``: the prompt's tokens and log-probs come first."""
        return self.kind == "completion" and bool(self.prompt_texts) and self.request.num_logprobs() is not None


def build_app(engine: LLMEngine | EngineProcess, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The app serving ``engine`` (in this process, on a thread; or an :class:`EngineProcess`);
    its engine loop starts and stops with the app's lifespan (``app.state.engine_loop``)."""
    if engine.tokenizer is None:
        raise ValueError("serving needs an engine with a tokenizer")
    if isinstance(engine, EngineProcess):
        loop, facts = ProcessEngineLoop(engine, max_waiting=settings.max_waiting), engine.facts
    else:
        loop, facts = EngineLoop(engine, max_waiting=settings.max_waiting), EngineFacts.of(engine)
    limits = Limits(max_n=min(settings.max_n, facts.max_num_seqs), max_tokens=settings.max_tokens,
                    max_logprobs=facts.vocab_size if settings.max_logprobs == -1 else settings.max_logprobs,
                    vocab_size=facts.vocab_size, context=facts.max_positions, kv_tokens=facts.kv_tokens,
                    kv_block_size=facts.kv_block_size, scheduling_policy=facts.scheduling_policy)
    drain = Drain(lambda: loop.end_all(shutting_down()), settings.shutdown_timeout_s)
    defaults = _checked_defaults(facts.sampling_defaults) if settings.generation_config == "auto" else {}
    models = OpenAIServingModels(loop, settings.model_name, settings.lora_modules, limits.context, facts.max_loras)
    serving = _OpenAIServing(loop, copy.deepcopy(engine.tokenizer), settings, limits, drain, defaults, models)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)
            serving.tokenizers.close()

    app = FastAPI(title="hf_paged", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop
    app.state.drain = drain  # the server's signal handling drives it (server.py)
    app.state.sampling_defaults = serving.defaults
    app.state.models = models
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    _add_error_handlers(app)
    auth = [Depends(_api_key_check(settings.api_key))]
    for path, handler, guard in (("/health", serving.health, []), ("/metrics", serving.metrics, []),
                                 ("/load", serving.load, []), ("/v1/models", serving.models, auth),
                                 ("/v1/models/{model_id:path}", serving.model, auth)):
        app.add_api_route(path, handler, methods=["GET"], dependencies=guard)
        # HEAD as HTTP has it (load balancers and uptime checks probe with it); not a separate operation
        app.add_api_route(path, handler, methods=["HEAD"], dependencies=guard, include_in_schema=False)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) name of /health; a route per method: one operation id each
        app.add_api_route("/ping", serving.health, methods=[method])
    app.add_api_route("/reset_prefix_cache", serving.reset_prefix_cache, methods=["POST"], dependencies=auth)
    app.add_api_route("/version", serving.version, methods=["GET"])
    bodies = {"/v1/completions": (serving.completions, CompletionRequest),
              "/v1/chat/completions": (serving.chat, ChatCompletionRequest),
              "/v1/responses": (serving.responses, responses_api.ResponsesRequest),
              "/tokenize": (serving.tokenize, (TokenizeCompletionRequest, TokenizeChatRequest)),
              "/detokenize": (serving.detokenize, DetokenizeRequest)}
    if settings.allow_runtime_lora_updating or runtime_lora_updating():  # vLLM's switch; else 404 as unknown
        logger.warning("LoRA adapters may be loaded and unloaded at runtime (/v1/load_lora_adapter)")
        bodies |= {"/v1/load_lora_adapter": (serving.load_lora_adapter, LoadLoRAAdapterRequest),
                   "/v1/unload_lora_adapter": (serving.unload_lora_adapter, UnloadLoRAAdapterRequest)}
    for path, (handler, _) in bodies.items():
        app.add_api_route(path, handler, methods=["POST"], dependencies=auth)
    _publish_request_bodies(app, {path: model for path, (_, model) in bodies.items()})
    return app


def _publish_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel] | tuple[type[BaseModel], ...]]) -> None:
    """``/openapi.json`` with each POST route's request model, or models (any one of them), as the
    handlers read the body themselves, so FastAPI cannot see it: clients and fuzzers learn every
    field and its type."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, models in bodies.items():
                refs = []
                for model in models if isinstance(models, tuple) else (models,):
                    body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    components.update(body.pop("$defs", {}))
                    components[model.__name__] = body
                    refs.append({"$ref": f"#/components/schemas/{model.__name__}"})
                ref = refs[0] if len(refs) == 1 else {"anyOf": refs}
                schema["paths"][path]["post"]["requestBody"] = {"required": True,
                                                                "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---------------------------------------------------------------------------- errors, key, body size
def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        headers = err.headers
        if err.status_code == 405:  # Allow: every method the path answers (Starlette names one route's)
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code,
                            headers=headers)

    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(_, invalid(None, str(err.errors()[0].get("msg"))))

    async def client_left(_: Request, err: ClientDisconnect) -> Response:
        logger.info("a client left before sending its whole request body")
        return Response(status_code=499)  # nobody reads it

    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ClientDisconnect, client_left)  # not a server error: no traceback
    app.add_exception_handler(Exception, internal_error)


def _allowed_methods(request: Request) -> str:
    """The methods of every route on the request's path: GET and HEAD are separate routes here
    (HEAD is left out of the schema), so a 405 lists both."""
    methods = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _api_key_check(api_key: str | None):
    """A dependency comparing ``Authorization: Bearer <key>`` in constant time (none: no check)."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(got, expected):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer ...)", code="invalid_api_key")

    return check


class _BodyLimit:
    """Refuses bodies over ``limit`` bytes with 413: by Content-Length before reading, else as read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            response = JSONResponse(self._error().body(), status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise self._error()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> APIError:
        return APIError(413, f"request body over {self.limit} bytes", code="request_too_large")


def _chat_ids(tokenizer, conversation: list[dict], tools: list[dict] | None = None, template: str | None = None,
              template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
    """A conversation's prompt token ids through the chat template (``template``: None is the
    tokenizer's), on a tokenizer worker thread. The template writes the special tokens it wants
    (``add_special_tokens`` adds the tokenizer's own on top, as /tokenize may ask)."""
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template, tokenize=False,
                                             **kwargs)
    except Exception as err:  # noqa: BLE001 - a template's own error (e.g. raise_exception in Jinja)
        raise invalid("messages", f"the chat template refused the messages: {err}") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _request_failure(output: RequestOutput) -> APIError:
    """The answer for a request the engine ended with an error: a 400 when it was refused as never
    fitting, a 503 when the engine failed it."""
    if output.error_kind == FAULT:
        return APIError(503, f"the engine failed this request: {output.error}", code="engine_error")
    # the scheduler's refusals are about length; a request whose masks leave no token names its fields itself
    return invalid("max_tokens" if "KV blocks" in output.error else None, output.error)


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    """Wait for the client to go away (after the body, ``receive`` yields only that), then abort."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    stream.abort()


def _checked_defaults(defaults: dict[str, float | int]) -> dict[str, float | int]:
    """The model's request defaults, refused at start when out of range (else every request that
    leaves one unset would get a 400 naming a field it did not send)."""
    try:
        SamplingParams(**defaults)  # max_tokens is SamplingParams' vLLM spelling of max_new_tokens
    except ValueError as err:
        raise ValueError(f"the model's generation config holds a value requests cannot take ({err}); fix "
                         "generation_config.json or serve with --generation-config vllm") from None
    return defaults


# ---------------------------------------------------------------------------- the routes
class _OpenAIServing:
    def __init__(self, loop: EngineLoop, tokenizer, settings: ServerSettings, limits: Limits, drain: Drain,
                 defaults: dict[str, float | int], models: OpenAIServingModels):
        self.loop, self.tokenizer, self.settings, self.limits, self.drain = loop, tokenizer, settings, limits, drain
        self.serving_models = models  # the base model and the LoRA adapters a request's model may name
        self.defaults = defaults  # request defaults from the model's generation config (params.generation_defaults)
        self.tokenizers = TokenizerPool(tokenizer)
        self.token_text = responses.TokenText(tokenizer)
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.document_start = [] if start is None else [start]  # what a completion without a prompt continues

    def _unavailable(self) -> APIError | None:
        """Why generation requests get a 503 now (None: they are served)."""
        if not self.loop.alive:
            return APIError(503, "the engine loop is not running", code="engine_unhealthy")
        if self.drain.draining:
            return APIError(503, "the server is shutting down", code="server_shutting_down")
        if not self.loop.healthy:
            return APIError(503, "the engine is unhealthy: its last steps failed (see the server log)",
                            code="engine_unhealthy")
        return None

    async def health(self) -> Response:
        problem = self._unavailable()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": problem.code, "message": problem.message}, status_code=503)

    async def metrics(self) -> Response:
        """Always a scrape: an engine that cannot answer (dead, or stuck for 10 s) is
        ``engine_healthy 0`` beside the server's own series, which is when a scrape matters most."""
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(self.loop.call(engine_stats)), timeout=10)
        except (asyncio.TimeoutError, EngineFailure):
            stats = {"healthy": False}
        return PlainTextResponse(self.loop.metrics.render(stats, self.settings.model_name),
                                 media_type="text/plain; version=0.0.4")

    async def load(self) -> dict:
        """vLLM's ``/load``: the generation requests being answered now (a load balancer's measure)."""
        return {"server_load": self.drain.active}

    async def reset_prefix_cache(self) -> Response:
        """Forget every cached prefix block (vLLM's route of the same name; benchmarks call it between
        runs, operators after changing the weights). The engine does it between steps, and only
        when no request is in flight (their blocks would enter the cache again): a 409 otherwise."""
        self._check_available()
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(self.loop.call(LLMEngine.reset_prefix_cache)), 30)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine loop did not answer") from None
        if not done:
            raise APIError(409, "requests are in flight: the prefix cache is reset only when none are",
                           code="requests_in_flight")
        return JSONResponse({"reset": True})

    async def models(self) -> dict:
        """The base model, then each LoRA adapter (``root``: its folder, ``parent``: the base model)."""
        return {"object": "list", "data": self.serving_models.cards()}

    async def model(self, model_id: str) -> dict:
        return self.serving_models.card(model_id)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` (where runtime updates are allowed): the engine reads
        and checks the adapter now; a plain-text success, as vLLM's."""
        req = parse(LoadLoRAAdapterRequest, decode_body(await request.body()))
        self._check_available()
        return PlainTextResponse(await self.serving_models.load_lora_adapter(req))

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter``: 404 for an adapter not served, 400 while requests
        in flight use it."""
        req = parse(UnloadLoRAAdapterRequest, decode_body(await request.body()))
        self._check_available()
        return PlainTextResponse(await self.serving_models.unload_lora_adapter(req))

    def _check_available(self) -> None:
        problem = self._unavailable()
        if problem is not None:
            raise problem

    async def _parse(self, request: Request, model):
        req = parse(model, decode_body(await request.body()))
        self.serving_models.lora_request(req.model)  # a 404 for a model not served; left out: the base model (vLLM's)
        req.check(self.limits)
        req.fill_defaults(self.defaults)
        return req

    def _admit(self) -> Ticket:
        """A generation request's place in the shutdown accounting; a 503 when it cannot be served."""
        problem = self._unavailable()
        if problem is not None and problem.code != "engine_unhealthy":  # unhealthy: keep trying, /health tells
            raise problem
        return self.drain.admit()

    # ------------------------------------------------------------------ completions and chat
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._completion_job)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self._chat_job)

    async def _serve(self, request: Request, build) -> Response:
        """Admit, build the job (parse, check, tokenize), run it. A stream's ticket goes with its
        response (released when the stream ends); every other answer releases it here."""
        ticket = self._admit()
        streaming = False
        try:
            job, prompts, params = await build(request, ticket)
            response = await self._run(job, prompts, params, request)
            streaming = isinstance(response, BoundedStreamingResponse)
            return response
        finally:
            if not streaming:
                ticket.release()

    async def _completion_job(self, request: Request, ticket: Ticket):
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        prompts = req.prompts(self.document_start)
        encoded, texts, decoded = await self.tokenizers.run(self._encode_prompts, prompts, req)
        # unset: 16 (as vLLM: not the model's max_new_tokens), at most what fits after each prompt
        asked = 1 if req.prompt_only() else req.max_tokens  # the token drawn for nothing is left out of the answer
        max_tokens = [resolve_max_tokens(asked, COMPLETIONS_DEFAULT_MAX_TOKENS, len(ids), self.limits,
                                         "prompt", samples=req.samples) for ids in encoded]
        lora = self.serving_models.lora_request(req.model)
        job = _Job("completion", f"cmpl-{uuid.uuid4().hex}", req, texts, ticket, echoed_ids=decoded,
                   model=self.serving_models.model_name(lora), lora=lora)
        params = {n: req.sampling_params(n) for n in set(max_tokens)}
        await self._compile_constraint(req, params[max_tokens[0]])
        return job, encoded, params[max_tokens[0]] if len(params) == 1 else [params[n] for n in max_tokens]

    async def _chat_job(self, request: Request, ticket: Ticket, req: ChatCompletionRequest | None = None):
        """``req``: the chat request a Responses request amounts to (else the body is one)."""
        if req is None:
            req = await self._parse(request, ChatCompletionRequest)
        ids = await self.tokenizers.run(_chat_ids, req.conversation(), req.template_tools(), self._chat_template(req),
                                        req.template_kwargs())
        ids = req.truncated(ids, self.limits, self.defaults.get("max_tokens"))
        max_tokens = resolve_max_tokens(req.max_tokens, self.defaults.get("max_tokens"), len(ids), self.limits,
                                        "messages", req.max_tokens_param, req.samples)
        echoed = req.echoed_text()
        lora = self.serving_models.lora_request(req.model)
        job = _Job("chat", f"chatcmpl-{uuid.uuid4().hex}", req, [echoed] if echoed else [], ticket,
                   model=self.serving_models.model_name(lora), lora=lora, tools=req.tool_mode != "none",
                   calls_only=req.tool_mode not in ("none", "auto"))
        params = req.sampling_params(max_tokens)
        await self._compile_constraint(req, params)
        return job, [ids], params

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the chat request it amounts to, answered as a Response
        (:mod:`.responses_api`); errors name the fields the client sent."""
        with responses_api.in_responses_terms():
            return await self._serve(request, self._responses_job)

    async def _responses_job(self, request: Request, ticket: Ticket):
        req = responses_api.read_request(decode_body(await request.body()))
        models = self.serving_models
        chat = req.chat_request(models.model_name(models.lora_request(req.model)), self.limits, self.defaults)
        job, prompts, params = await self._chat_job(request, ticket, chat)
        job.view = responses_api.ResponseRenderer(req, params, self.tokenizer, job.model,
                                                  tools=job.tools, calls_only=job.calls_only, failure=_request_failure)
        job.response_id = job.view.id
        return job, prompts, params

    def _chat_template(self, req: ChatTemplateFields) -> str | None:
        """The template a chat request renders with: its own (when the server trusts requests'),
        the server's ``--chat-template``, or the tokenizer's (None); a 400 when there is none."""
        if req.chat_template is not None:
            if not self.settings.trust_request_chat_template:
                raise invalid("chat_template", "this server takes no chat_template from requests (start it with "
                                               "--trust-request-chat-template to allow them)")
            return req.chat_template
        if self.settings.chat_template is not None:
            return self.settings.chat_template
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("messages", "this model's tokenizer has no chat template (serve with --chat-template)")
        return None

    # ------------------------------------------------------------------ vLLM's tokenizer routes
    async def tokenize(self, request: Request) -> dict:
        """A prompt's token ids as a completion (``prompt``) or a chat completion (``messages``)
        would get them; no generation, no engine."""
        body = decode_body(await request.body())
        chat = isinstance(body, dict) and "messages" in body
        req = parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        self.serving_models.lora_request(req.model)  # a 404 for a model not served (adapters share the tokenizer)
        if chat:
            req.check_template_fields()
            try:
                tools = tool_calling.read_tools(req.tools or [])
            except tool_calling.ToolError as err:
                raise invalid(err.param, str(err)) from None
            ids = await self.tokenizers.run(_chat_ids, req.conversation(), [tool.entry for tool in tools] or None,
                                            self._chat_template(req), req.template_kwargs(),
                                            bool(req.add_special_tokens))
        else:
            ids = await self.tokenizers.run(
                lambda tokenizer: list(tokenizer(req.prompt, add_special_tokens=bool(req.add_special_tokens))["input_ids"]))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.limits.context, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        req = parse(DetokenizeRequest, decode_body(await request.body()))
        self.serving_models.lora_request(req.model)  # a 404 for a model not served
        vocab = self.limits.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise invalid(f"tokens[{bad}]", f"tokens must be ids in [0, {vocab}), got {req.tokens[bad]}")
        return {"prompt": await self.tokenizers.run(lambda tokenizer: tokenizer.decode(req.tokens))}

    async def version(self) -> dict:
        return {"version": hf_paged.__version__}

    async def _compile_constraint(self, req, params: SamplingParams) -> None:
        """Compile the request's constraint before it is queued, so that a bad one is a 400 before
        any stream starts (the engine then finds it in the compiler's cache). The compile runs on
        the compiler's threads; the wait is shielded, so a client that leaves cancels nothing
        another request waits for."""
        constraint, param = params.structured_outputs, req.constraint_field
        if constraint is None:
            return
        compiler = self.loop.compiler
        try:
            future = asyncio.wrap_future(compiler.submit(constraint))
            await asyncio.wait_for(asyncio.shield(future), compiler.timeout_s)
        except asyncio.TimeoutError:
            raise invalid(param, f"{param}: {too_slow(constraint, compiler.timeout_s)}") from None
        except ConstraintError as err:
            raise invalid(param, f"{param}: {err}") from None

    def _encode_prompts(self, tokenizer, prompts: list[str | list[int]], req: CompletionRequest):
        """(token ids, echoed texts, whether each echoed text is its ids decoded) of the prompts,
        truncated as ``truncate_prompt_tokens`` asks: on a tokenizer worker thread. A prompt sent
        as text echoes as sent, unless truncation cut it."""
        encoded = [self._encode(tokenizer, p) for p in prompts]
        cut = [req.truncated(ids, self.limits, COMPLETIONS_DEFAULT_MAX_TOKENS) for ids in encoded]
        decoded = [not isinstance(p, str) or len(c) < len(ids) for p, ids, c in zip(prompts, encoded, cut)]
        texts = [tokenizer.decode(c) if d else p for p, c, d in zip(prompts, cut, decoded)] if req.echo else []
        return cut, texts, decoded

    def _encode(self, tokenizer, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if self.limits.vocab_size is not None and any(not 0 <= t < self.limits.vocab_size for t in prompt):
            raise invalid("prompt", f"prompt token ids must be below the vocabulary size {self.limits.vocab_size}")
        return list(prompt)

    async def _run(self, job: _Job, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                   request: Request) -> Response:
        if not self.serving_models.serves(job.lora):  # unloaded while the request was tokenized
            self.serving_models.lora_request(job.lora.lora_name)  # the 404
        job.stream = self.loop.submit(prompts, params, job.response_id, final_only=not job.request.stream,
                                      priority=job.request.priority or 0, lora_request=job.lora)
        try:
            await job.stream.accepted()
        except Overloaded as err:
            raise APIError(503, str(err), code="server_overloaded") from None
        except ValueError as err:
            param = "messages" if job.kind == "chat" else "prompt"
            if job.lora is not None and "LoRA" in str(err):  # its adapter's folder can no longer be read
                param = "model"
            raise invalid(param, str(err)) from None
        except EngineFailure as err:
            raise APIError(503, str(err), code=err.code) from None
        except BaseException:  # cancelled while waiting: drop what may have been queued
            job.stream.abort()
            raise
        watcher = asyncio.create_task(_abort_on_disconnect(request, job.stream))
        if job.request.stream:
            events = self._events(job, watcher) if job.view is None else job.view.events(job.stream, watcher)
            return BoundedStreamingResponse(events, send_timeout=self.settings.stream_timeout_s,
                                            on_timeout=self.loop.metrics.stream_timeout, on_close=job.ticket.release)
        try:
            finals = {i: out async for i, out in job.stream if out.finished}
        except EngineFailure as err:
            raise APIError(503, str(err), code=err.code) from None
        finally:
            watcher.cancel()
            job.stream.abort()
        if len(finals) < len(prompts):
            return Response(status_code=499)  # the client left; nobody reads this
        outputs = [finals[i] for i in range(len(prompts))]
        failed = next((o for o in outputs if o.error), None)
        if failed is not None:
            raise _request_failure(failed)
        return JSONResponse(self._response(job, outputs) if job.view is None else job.view.body(outputs))

    def _response(self, job: _Job, outputs: list[RequestOutput]) -> dict:
        req, choices = job.request, []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                prefix = job.prompt_texts[i] if job.prompt_texts else ""
                text, calls, finish = c.text, None, c.finish_reason
                if job.tools:  # the model's <tool_call> blocks as tool_calls (serve/tools.py)
                    text, found = parse_tool_calls(c.text, job.calls_only)
                    calls = [call.body() for call in found]
                    finish = "tool_calls" if found and finish == "stop" else finish
                if prefix:  # chat's content is None when the output is calls only
                    text = prefix + (text or "")
                generated, generated_logprobs, stop_reason = c.token_ids, c.logprobs, c.stop_reason
                if req.prompt_only():  # echo with max_tokens=0: the prompt alone
                    text, finish, stop_reason = prefix, "length", None
                    generated, generated_logprobs = [], None if c.logprobs is None else []
                ids, entries = self._echoed(job, out, generated, generated_logprobs)
                choices.append(responses.choice(
                    job.kind, i * job.n + c.index, text, finish,
                    self._logprobs(job, ids, entries, self._text_offsets(job, i, len(ids) - len(generated))),
                    generated if req.return_token_ids else None,
                    tool_calls=calls, stop_reason=stop_reason, role=self._role(job)))
                if req.return_token_ids and job.kind == "completion":  # vLLM's: per choice (chat: once, below)
                    choices[-1]["prompt_token_ids"] = list(out.prompt_token_ids)
                if req.prompt_logprobs is not None and job.kind == "completion":  # vLLM's: per choice
                    choices[-1]["prompt_logprobs"] = responses.prompt_logprobs(self.token_text, out.prompt_logprobs)
        choices.sort(key=lambda ch: ch["index"])
        usage = responses.usage(outputs)
        if req.prompt_only():
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        body = responses.envelope(job.kind, job.response_id, job.model, choices, usage)
        if req.prompt_logprobs is not None and job.kind == "chat":  # vLLM's: one conversation, one list
            body["prompt_logprobs"] = responses.prompt_logprobs(self.token_text, outputs[0].prompt_logprobs)
        if req.return_token_ids and job.kind == "chat":
            body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
        return body

    @staticmethod
    def _role(job: _Job) -> str:
        return job.request.response_role() if job.kind == "chat" else "assistant"

    @staticmethod
    def _echoed(job: _Job, out: RequestOutput, token_ids: list[int], logprobs) -> tuple[list[int], list | None]:
        """The tokens and log-probs a choice reports: with ``echo`` and ``logprobs``, the prompt's
        first (the first prompt token has no log-prob: ``None``), as OpenAI's legacy API does."""
        if not job.echoes_logprobs or logprobs is None:
            return token_ids, logprobs
        return [*out.prompt_token_ids, *token_ids], [*(out.prompt_logprobs or [None]), *logprobs]

    @staticmethod
    def _text_offsets(job: _Job, prompt_index: int, echoed: int) -> responses.TextOffsets:
        """Where a choice's ``text_offset`` counts from; its first ``echoed`` tokens are the prompt's."""
        return responses.TextOffsets(shows_special=not job.stream.params(prompt_index).skip_special_tokens,
                                     echoed=echoed, echo_shows_special=bool(echoed) and job.echoed_ids[prompt_index])

    def _logprobs(self, job: _Job, token_ids: list[int], logprobs, offsets: responses.TextOffsets) -> dict | None:
        k = job.request.num_logprobs()
        if k is None or logprobs is None:
            return None
        text_of = responses.TokenIdText(self.token_text) if job.request.return_tokens_as_token_ids else self.token_text
        if job.kind == "chat":
            return responses.chat_logprobs(text_of, token_ids, logprobs, k)
        return responses.completion_logprobs(text_of, token_ids, logprobs, k, offsets)

    # ------------------------------------------------------------------ streaming
    async def _events(self, job: _Job, watcher: asyncio.Task) -> AsyncIterator[str]:
        """SSE chunks, ``[DONE]`` last; the requests are aborted if the stream stops early."""
        req, created = job.request, int(time.time())
        with_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = with_usage and bool(req.stream_options.continuous_usage_stats)  # vLLM's: usage in every chunk
        texts: dict[int, TextStream] = {}
        offsets: dict[int, responses.TextOffsets] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in job.stream:
                if out.error:
                    yield responses.sse(_request_failure(out).body())
                    break
                if out.finished:
                    finals[i] = out
                for c in out.outputs:
                    index = i * job.n + c.index
                    if job.kind == "chat" and index not in texts:  # the role first, alone (as OpenAI and vLLM)
                        yield self._opening_chunk(job, index, out, created, with_usage, continuous)
                        if job.prompt_texts:  # echo: the last message's text next, alone (as vLLM)
                            yield self._opening_chunk(job, index, out, created, with_usage, continuous,
                                                   echo=job.prompt_texts[i])
                    chunk = self._chunk(job, index, c, texts, offsets, i, out)
                    if chunk is not None:
                        so_far = responses.choice_usage(out, c) if continuous else None
                        yield responses.sse(responses.envelope(job.kind, job.response_id, job.model,
                                                               [chunk], so_far, chunk=True, created=created,
                                                               null_usage=with_usage))
            else:
                if with_usage:
                    yield responses.sse(responses.envelope(job.kind, job.response_id, job.model, [],
                                                           responses.usage(list(finals.values())), chunk=True,
                                                           created=created))
        except EngineFailure as err:
            yield responses.sse(APIError(503, str(err), code=err.code).body())
        finally:
            watcher.cancel()
            job.stream.abort()
        yield responses.sse("[DONE]")

    def _opening_chunk(self, job: _Job, index: int, out: RequestOutput, created: int, with_usage: bool,
                    continuous: bool, echo: str | None = None) -> str:
        """A chat choice's first chunk: its role and empty content (with ``return_token_ids``, the
        prompt's token ids too), sent when its first output comes, before any content; with
        ``echo``, the chunk that follows it: the echoed text as content (no tokens generated yet)."""
        if echo is None:
            choice = responses.choice("chat", index, "", None, delta=True, first=True, role=self._role(job))
        else:
            choice = responses.choice("chat", index, echo, None, delta=True)
        so_far = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": 0,
                  "total_tokens": len(out.prompt_token_ids)} if continuous else None
        body = responses.envelope("chat", job.response_id, job.model, [choice], so_far, chunk=True,
                                  created=created, null_usage=with_usage)
        if job.request.return_token_ids and echo is None:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return responses.sse(body)

    def _chunk(self, job: _Job, index: int, c, texts: dict[int, TextStream], offsets: dict[int, responses.TextOffsets],
               prompt_index: int, out: RequestOutput) -> dict | None:
        """The stream chunk for one completion's latest state (None: nothing new to send)."""
        first = index not in texts
        if first and job.echoes_logprobs and not (c.token_ids or out.finished):
            return None  # the prompt's log-probs are whole once its prefill is done: the first chunk waits
        if first:
            texts[index] = TextStream.of(self.tokenizer, job.stream.params(prompt_index), out.prompt_token_ids)
        text_stream = texts[index]
        if text_stream.finished:
            return None
        start = text_stream.num_tokens
        delta, new_ids = text_stream.update(c)
        calls, finish = None, c.finish_reason if text_stream.finished else None
        if job.tools:  # tool calling: <tool_call> blocks become tool-call deltas (serve/tools.py)
            parser = job.tool_parser(index)
            delta, found = parser.feed(delta, final=text_stream.finished)
            calls = [d.body() for d in found]
            finish = "tool_calls" if finish == "stop" and parser.calls else finish
        if first and job.prompt_texts and job.kind == "completion":  # chat's went in a chunk of its own
            delta = job.prompt_texts[prompt_index] + (delta or "")
        ids, entries = new_ids, c.logprobs[start: start + len(new_ids)] if c.logprobs else None
        if first:
            ids, entries = self._echoed(job, out, ids, entries)
            offsets[index] = self._text_offsets(job, prompt_index, len(ids) - len(new_ids))
        logprobs = self._logprobs(job, ids, entries, offsets[index])
        wants_tokens = bool(new_ids) and (logprobs is not None or job.request.return_token_ids)
        prompt_ids = first and job.kind == "completion" and job.request.return_token_ids
        if not (delta or calls or text_stream.finished or wants_tokens or prompt_ids):
            return None
        body = responses.choice(job.kind, index, delta, finish, logprobs,
                                new_ids if job.request.return_token_ids else None, delta=True,
                                tool_calls=calls, stop_reason=c.stop_reason if text_stream.finished else None)
        if prompt_ids:  # vLLM's: a completion choice's first chunk carries its prompt's token ids
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body
