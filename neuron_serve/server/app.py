"""FastAPI application: thin routes over the serving layer; errors raised, handlers render."""

from __future__ import annotations

import uuid

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from vllm.engine.protocol import EngineClient

from neuron_serve.server.errors import ServerError, register_error_handlers
from neuron_serve.server.metrics import render as render_metrics
from neuron_serve.server.chat import ChatService
from neuron_serve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                          CompletionRequest, CompletionResponse,
                                          DetokenizeRequest, DetokenizeResponse, ModelCard,
                                          ModelList, TokenizeRequest, TokenizeResponse)
from neuron_serve.server.serving import CompletionService


def build_app(engine: EngineClient, served_names: list[str]) -> FastAPI:
    """The HTTP app for one engine serving one model under `served_names`."""
    app = FastAPI(title="neuron-serve", version=__import__("neuron_serve").__version__)
    register_error_handlers(app)
    completions = CompletionService(engine, served_names)
    chat = ChatService(engine, served_names)
    root = engine.model_config.model
    version = __import__("neuron_serve").__version__

    @app.get("/health")
    async def health() -> Response:
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the app exists only once the engine has loaded and warmed the model."""
        await engine.check_health()
        return Response(status_code=200)

    @app.get("/version")
    async def get_version() -> dict:
        import vllm
        return {"version": version, "vllm": vllm.__version__}

    @app.post("/tokenize", response_model=TokenizeResponse)
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

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        if req.model is not None:
            completions.check_model(req.model)
        vocab = len(completions.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ServerError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                              param="tokens")
        return DetokenizeResponse(prompt=completions.tokenizer.decode(req.tokens))

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

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def create_chat_completion(req: ChatCompletionRequest):
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            events = await chat.stream(req, request_id)
            return StreamingResponse(events, media_type="text/event-stream")
        return await chat.complete(req, request_id)

    return app
