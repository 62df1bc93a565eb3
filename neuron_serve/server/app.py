"""FastAPI application: thin routes over the serving layer; errors raised, handlers render."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from vllm.engine.protocol import EngineClient
from vllm.v1.engine.exceptions import EngineDeadError

from neuron_serve.server.chat import ChatService
from neuron_serve.server.errors import ServerError, register_error_handlers
from neuron_serve.server.metrics import render as render_metrics
from neuron_serve.server.profiling import ProfileControl
from neuron_serve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    ProfileStarted,
    ProfileStopped,
    TokenizeRequest,
    TokenizeResponse,
)
from neuron_serve.server.serving import CompletionService, GenerationService


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


CLIENT_DISCONNECTED = 499  # nginx's code: logged, never seen by the (gone) client


async def _unless_disconnected(request: Request, work: Awaitable) -> Response:
    """`work`'s result, or cancel it when the client goes away: cancelling closes the
    engine's output stream, which aborts the request (no generation for nobody)."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else Response(status_code=CLIENT_DISCONNECTED)


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends. Starlette
    cancels a stream whose client left; when that lands while a chunk is being sent, the
    generator stays suspended and its engine request would run on until garbage collection."""
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _generation(request: Request, service: GenerationService, req, request_id: str):
    if req.stream:  # closing the event generator aborts the request in the engine
        return EventStream(await service.stream(req, request_id))
    return await _unless_disconnected(request, service.complete(req, request_id))


def build_app(engine: EngineClient, served_names: list[str], *,
              request_timeout_s: float | None = None, profile_dir: str | None = None) -> FastAPI:
    """The HTTP app for one engine serving one model under `served_names`; profiles are
    written under `profile_dir` (None: profiling is off)."""
    app = FastAPI(title="neuron-serve", version=__import__("neuron_serve").__version__)
    register_error_handlers(app)
    completions = CompletionService(engine, served_names, request_timeout_s)
    chat = ChatService(engine, served_names, request_timeout_s)
    profiler = ProfileControl(engine, profile_dir)
    root = engine.model_config.model
    version = __import__("neuron_serve").__version__

    async def check_engine() -> PlainTextResponse:
        try:
            await engine.check_health()
        except EngineDeadError as exc:
            raise ServerError("the engine has stopped; restart the server",
                              HTTPStatus.SERVICE_UNAVAILABLE) from exc
        return PlainTextResponse("")

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
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        if req.model is not None:
            completions.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ServerError("give exactly one of prompt or messages", param="prompt")
        tokens = (completions.chat_prompt_ids(req.messages, req.add_generation_prompt)
                  if req.messages is not None else
                  completions.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return TokenizeResponse(count=len(tokens), max_model_len=completions.max_model_len,
                                tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=_errors(HTTPStatus.NOT_FOUND))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        if req.model is not None:
            completions.check_model(req.model)
        vocab = len(completions.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ServerError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              param="tokens")
        return DetokenizeResponse(prompt=completions.tokenizer.decode(req.tokens))

    @app.get("/metrics", response_class=PrometheusResponse)
    async def metrics() -> PrometheusResponse:
        """vLLM's `vllm:` series and neuron-serve's `neuron_serve:` series."""
        return PrometheusResponse(await render_metrics(engine))

    @app.get("/v1/models", response_model=ModelList, responses=_errors())
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=completions.max_model_len)
                               for name in served_names])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
    async def create_completion(req: CompletionRequest, request: Request):
        return await _generation(request, completions, req, f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=GENERATION_RESPONSES)
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await _generation(request, chat, req, f"chatcmpl-{uuid.uuid4().hex}")

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
