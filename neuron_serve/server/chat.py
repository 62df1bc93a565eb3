"""Chat completions: messages through the model's chat template, then the shared
generation path; responses and stream chunks in OpenAI's chat shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator

from vllm.outputs import RequestOutput

from neuron_serve.server.errors import CLIENT_ERRORS, client_error
from neuron_serve.server.logprobs import chat_logprobs
from neuron_serve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    Usage,
)
from neuron_serve.server.serving import GenerationService, stream_error_event


class ChatService(GenerationService):
    def _generate(self, req: ChatCompletionRequest, request_id: str) -> tuple[list[int], AsyncIterator]:
        self.check_model(req.model)
        prompt = self.chat_prompt_ids(req.messages)
        return prompt, self.generate(req, request_id, [prompt])

    async def complete(self, req: ChatCompletionRequest, request_id: str) -> ChatCompletionResponse:
        prompt, outputs = self._generate(req, request_id)
        final: RequestOutput | None = None
        try:
            async for _, out in outputs:
                final = out
        except CLIENT_ERRORS as exc:
            raise client_error(exc) from exc
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              finish_reason=c.finish_reason, logprobs=self._logprobs(req, c),
                              token_ids=list(c.token_ids) if req.return_token_ids else None)
                   for c in final.outputs]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id, model=req.model, choices=choices,
            prompt_token_ids=prompt if req.return_token_ids else None,
            usage=Usage.of(len(prompt), completion_tokens))

    def _logprobs(self, req: ChatCompletionRequest, c) -> ChatLogprobs | None:
        if not req.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, self.tokenizer, req.top_logprobs or 0)

    async def stream(self, req: ChatCompletionRequest, request_id: str) -> AsyncIterator[str]:
        """Server-sent events: a role chunk per choice first, then content deltas; raising
        before the first event lets the route answer 4xx."""
        prompt, outputs = self._generate(req, request_id)
        return self._events(req, request_id, len(prompt), outputs)

    async def _events(self, req, request_id, prompt_tokens, outputs) -> AsyncIterator[str]:
        def event(choice: ChatStreamChoice | None, usage: Usage | None = None) -> str:
            chunk = ChatCompletionChunk(id=request_id, model=req.model,
                                        choices=[choice] if choice else [], usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        for index in range(req.n):
            yield event(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))
        completion_tokens = 0
        try:
            async for _, out in outputs:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    yield event(ChatStreamChoice(
                        index=c.index, delta=ChatDelta(content=c.text), finish_reason=c.finish_reason,
                        logprobs=self._logprobs(req, c),
                        token_ids=list(c.token_ids) if req.return_token_ids else None))
            if req.stream_usage:
                yield event(None, Usage.of(prompt_tokens, completion_tokens))
        except Exception as exc:  # noqa: BLE001 - headers are sent: reported in-band (DESIGN §6)
            yield stream_error_event(exc)
        yield "data: [DONE]\n\n"
