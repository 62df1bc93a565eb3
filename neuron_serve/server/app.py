"""FastAPI application: thin routes over the serving layer; errors raised, handlers render."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from vllm.engine.protocol import EngineClient

from neuron_serve.server.errors import register_error_handlers
from neuron_serve.server.metrics import render as render_metrics
from neuron_serve.server.protocol import CompletionRequest, CompletionResponse, ModelCard, ModelList
from neuron_serve.server.serving import CompletionService


def build_app(engine: EngineClient, served_names: list[str]) -> FastAPI:
    """The HTTP app for one engine serving one model under `served_names`."""
    app = FastAPI(title="neuron-serve", version=__import__("neuron_serve").__version__)
    register_error_handlers(app)
    completions = CompletionService(engine, served_names)
    root = engine.model_config.model

    @app.get("/health")
    async def health() -> Response:
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await render_metrics(engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=completions.max_model_len)
                               for name in served_names])

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def create_completion(req: CompletionRequest):
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            events = await completions.stream(req, request_id)
            return StreamingResponse(events, media_type="text/event-stream")
        return await completions.complete(req, request_id)

    return app
