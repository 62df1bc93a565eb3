"""FastAPI application: thin routes over vLLM's serving classes (openai_api.py) and our
own probes, metrics and profiling; errors raised, handlers render."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from vllm.entrypoints.serve.engine.protocol import ModelList
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm.v1.engine.exceptions import EngineDeadError

from neuron_serve.server import fields
from neuron_serve.server.engines import EngineWatch
from neuron_serve.server.errors import ENGINE_STOPPED, ServerError, register_error_handlers
from neuron_serve.server.metrics import render as render_metrics
from neuron_serve.server.openai_api import (
    conform_chat,
    conform_completion,
    conform_error,
    conform_response,
    init_serving,
    respond,
)
from neuron_serve.server.profiling import ProfileControl
from neuron_serve.server.protocol import ErrorResponse, ProfileStarted, ProfileStopped


def _errors(*statuses: HTTPStatus) -> dict:
    """OpenAPI entries for the error statuses a route (or the middleware in front) returns."""
    common = (HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return {int(s): {"model": ErrorResponse, "description": s.phrase} for s in (*common, *statuses)}


SSE_EVENT = {"type": "object", "required": ["data"],  # one event (OpenAPI 3.2 itemSchema)
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
GENERATION_RESPONSES = {
    200: {"content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
          "description": "JSON, or server-sent events when `stream` is true: `data:` holds a "
                         "chunk as JSON, an error object, or `[DONE]` last"},
    **_errors(HTTPStatus.NOT_FOUND, HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.SERVICE_UNAVAILABLE,
              HTTPStatus.GATEWAY_TIMEOUT),
}


class PrometheusResponse(Response):
    media_type = CONTENT_TYPE_LATEST


async def build_app(engine: EngineClient, args: Namespace, *,
                    request_timeout_s: float | None = None, profile_dir: str | None = None,
                    init: Callable[..., Awaitable[None]] = init_serving) -> FastAPI:
    """The HTTP app for one engine; `args` holds vLLM's frontend flags (chat template, tool
    and reasoning parsers, served model names), from which `init` puts vLLM's serving
    objects on the app's state. Profiles are written under `profile_dir` (None: profiling
    is off)."""
    version = __import__("neuron_serve").__version__
    app = FastAPI(title="neuron-serve", version=version)
    register_error_handlers(app)
    await init(engine, args, app.state)
    state = app.state
    profiler = ProfileControl(engine, profile_dir)

    state.engine_watch = EngineWatch(engine)  # run by the caller, beside the server

    async def check_engine() -> PlainTextResponse:
        try:
            await engine.check_health()
        except EngineDeadError as exc:
            raise ServerError(ENGINE_STOPPED, HTTPStatus.SERVICE_UNAVAILABLE) from exc
        if state.engine_watch.lost:
            raise ServerError(f"{state.engine_watch.lost}; the server is exiting",
                              HTTPStatus.SERVICE_UNAVAILABLE)
        return PlainTextResponse("")

    async def answer(request: Request, work, conform=conform_error) -> Response:
        return await respond(request, work, request_timeout_s, conform)

    probe = dict(response_class=PlainTextResponse, responses=_errors(HTTPStatus.SERVICE_UNAVAILABLE))

    @app.get("/health", **probe)
    async def health() -> PlainTextResponse:
        """Liveness: 200 while the engine runs."""
        return await check_engine()

    @app.get("/ready", **probe)
    async def ready() -> PlainTextResponse:
        """Readiness: the app exists only once the engine has loaded and warmed the model;
        503 while draining."""
        return await check_engine()

    @app.get("/version")
    async def get_version() -> dict:
        import vllm
        return {"version": version, "vllm": vllm.__version__}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(HTTPStatus.NOT_FOUND))
    async def tokenize(req: TokenizeRequest, request: Request):
        return await answer(request, state.serving_tokenization.create_tokenize(req, request))

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=_errors(HTTPStatus.NOT_FOUND))
    async def detokenize(req: DetokenizeRequest, request: Request):
        vocab = engine.model_config.get_vocab_size()
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:  # vLLM would decode them to something
            raise ServerError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              param="tokens")
        return await answer(request, state.serving_tokenization.create_detokenize(req, request))

    @app.get("/metrics", response_class=PrometheusResponse)
    async def metrics() -> PrometheusResponse:
        """vLLM's `vllm:` series and neuron-serve's `neuron_serve:` series."""
        return PrometheusResponse(await render_metrics(engine))

    @app.get("/v1/models", response_model=ModelList, responses=_errors())
    async def models(request: Request):
        return await answer(request, state.openai_serving_models.show_available_models())

    @app.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def create_completion(req: CompletionRequest, request: Request):
        fields.refuse_unhonoured(req, fields.COMPLETION)
        return await answer(request, state.openai_serving_completion.create_completion(req, request),
                            conform_completion)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=GENERATION_RESPONSES)
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        fields.refuse_unhonoured(req, fields.CHAT)
        return await answer(request, state.openai_serving_chat.create_chat_completion(req, request),
                            conform_chat)

    @app.post("/v1/responses", response_model=ResponsesResponse, responses=GENERATION_RESPONSES)
    async def create_response(req: ResponsesRequest, request: Request):
        """OpenAI's Responses API: text in, text out, streamed or not."""
        return await answer(request, state.openai_serving_responses.create_responses(req, request),
                            conform_response)

    @app.post("/admin/profile/start", response_model=ProfileStarted,
              responses=_errors(HTTPStatus.CONFLICT))
    async def profile_start() -> ProfileStarted:
        """Record the serving steps with torch.profiler until /admin/profile/stop."""
        return await profiler.start()

    @app.post("/admin/profile/stop", response_model=ProfileStopped,
              responses=_errors(HTTPStatus.CONFLICT))
    async def profile_stop() -> ProfileStopped:
        """Write the trace and a Parquet table of per-operator CPU time; returns their paths."""
        return await profiler.stop()

    return app
