"""An OpenAI-compatible HTTP server on ``LLMEngine`` (``hf-paged serve``), on FastAPI + uvicorn.

``app.py`` routes and errors, ``protocol.py`` request bodies and their ``SamplingParams``,
``engine_loop.py`` the one thread that owns the engine (or talks to it), ``engine_process.py`` the
engine in a process of its own (``hf-paged serve``'s default), ``responses.py`` response bodies,
``responses_api.py`` OpenAI's Responses API (``/v1/responses``) over the chat path, ``serving_models.py``
the base model and the LoRA adapters requests may name (``/v1/models``, runtime loading), ``tools.py``
tool calls, ``metrics.py`` Prometheus text, ``streaming.py`` send timeouts for clients that do not read,
``shutdown.py`` the graceful drain on SIGTERM/SIGINT, ``tokenizer_pool.py`` tokenization off the
event loop, ``server.py`` running it. Streamed text is ``hf_paged.engine.detokenize``'s.
"""

from hf_paged.serve.app import ServerSettings, build_app
from hf_paged.serve.engine_loop import EngineLoop, ProcessEngineLoop
from hf_paged.serve.engine_process import EngineProcess
from hf_paged.serve.server import ServerThread
from hf_paged.serve.serving_models import LoRAModulePath

__all__ = ["EngineLoop", "EngineProcess", "LoRAModulePath", "ProcessEngineLoop", "ServerSettings", "ServerThread",
           "build_app"]
