"""OpenAI request → vLLM SamplingParams → engine → OpenAI response.

`GenerationService` holds what completions and chat share (model check, prompt tokens,
sampling parameters, submitting to the engine); `CompletionService` renders completions
(chat.py renders chat). Engine-agnostic: any vLLM `EngineClient` (AsyncLLM in production).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from http import HTTPStatus

from vllm import SamplingParams
from vllm.engine.protocol import EngineClient
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.utils.async_utils import merge_async_iterators

from neuron_serve.server.errors import CLIENT_ERRORS, ServerError, client_error
from neuron_serve.server.logprobs import completion_logprobs
from neuron_serve.server.protocol import (
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    SamplingRequest,
    Usage,
)


class GenerationService:
    def __init__(self, engine: EngineClient, served_names: list[str],
                 request_timeout_s: float | None = None):
        self.engine = engine
        self.served_names = served_names
        self.request_timeout_s = request_timeout_s
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.get_tokenizer()

    def check_model(self, name: str) -> None:
        if name not in self.served_names:
            raise ServerError(f"model {name!r} does not exist; this server serves "
                              f"{self.served_names}", HTTPStatus.NOT_FOUND, "model")

    def prompt_token_ids(self, prompt: str | list) -> list[list[int]]:
        """The four prompt forms OpenAI accepts, as token-id lists."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts:
            raise ServerError("prompt must not be empty", param="prompt")
        return [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

    def chat_prompt_ids(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """The conversation through the model's chat template, as token ids."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ServerError("this model has no chat template; use /v1/completions",
                              param="messages")
        turns = [{"role": m.role, "content": _text_content(m.content)} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                turns, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as exc:  # templates raise anything; the input is at fault
            raise ServerError(f"the chat template rejected the messages: {exc}",
                              param="messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def sampling_params(self, req: SamplingRequest, prompt_len: int) -> SamplingParams:
        max_tokens = req.requested_max_tokens or self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise ServerError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} and max_tokens asks for {max_tokens} more. Shorten "
                "the prompt or lower max_tokens.", param="max_tokens")
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, max_tokens=max_tokens,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logit_bias=bias or None,
            skip_special_tokens=req.skip_special_tokens, logprobs=req.num_logprobs,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        )

    def generate(self, req: SamplingRequest, request_id: str,
                 prompts: list[list[int]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit every prompt; outputs of all of them, tagged with the prompt's index."""
        try:
            streams = [self.engine.generate(TokensPrompt(prompt_token_ids=ids),
                                            self.sampling_params(req, len(ids)),
                                            f"{request_id}-{i}")
                       for i, ids in enumerate(prompts)]
        except CLIENT_ERRORS as exc:
            raise client_error(exc) from exc
        merged = merge_async_iterators(*streams)
        return merged if self.request_timeout_s is None else _within(merged, self.request_timeout_s)


async def _within(outputs: AsyncIterator, seconds: float) -> AsyncIterator:
    """`outputs` until `seconds` have passed, then a 504; closing `outputs` aborts the
    request in the engine, so a timed-out generation stops using the device."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(outputs), deadline - loop.time())
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise ServerError(f"the request did not finish within {seconds:g} s "
                                  "(--request-timeout)", HTTPStatus.GATEWAY_TIMEOUT) from None
            yield item
    finally:
        await outputs.aclose()


def _text_content(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if any(part.get("type") != "text" for part in content):
        raise ServerError("only text content parts are supported", param="messages")
    return "".join(part.get("text", "") for part in content)


class CompletionService(GenerationService):
    def _generate(self, req: CompletionRequest, request_id: str) -> tuple[list[list[int]], AsyncIterator]:
        self.check_model(req.model)
        prompts = self.prompt_token_ids(req.prompt)
        return prompts, self.generate(req, request_id, prompts)

    async def complete(self, req: CompletionRequest, request_id: str) -> CompletionResponse:
        prompts, merged = self._generate(req, request_id)
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merged:
                finals[i] = out
        except CLIENT_ERRORS as exc:
            raise client_error(exc) from exc
        choices, completion_tokens = [], 0
        for i in range(len(prompts)):
            prefix = self.tokenizer.decode(prompts[i]) if req.echo else ""
            for c in finals[i].outputs:
                completion_tokens += len(c.token_ids)
                choices.append(CompletionChoice(
                    index=i * req.n + c.index, text=prefix + c.text, finish_reason=c.finish_reason,
                    logprobs=self._logprobs(req, c, len(prefix)),
                    **self._token_ids(req, prompts[i], c.token_ids)))
        return CompletionResponse(
            id=request_id, model=req.model, choices=sorted(choices, key=lambda c: c.index),
            usage=Usage.of(sum(map(len, prompts)), completion_tokens))

    def _logprobs(self, req: CompletionRequest, c, offset: int) -> CompletionLogprobs | None:
        if req.logprobs is None or c.logprobs is None:
            return None
        return completion_logprobs(c.token_ids, c.logprobs, self.tokenizer, offset)

    @staticmethod
    def _token_ids(req: CompletionRequest, prompt: list[int], output) -> dict:
        if not req.return_token_ids:
            return {}
        return {"prompt_token_ids": prompt, "token_ids": list(output)}

    async def stream(self, req: CompletionRequest, request_id: str) -> AsyncIterator[str]:
        """Server-sent events; raising before the first event lets the route answer 4xx."""
        prompts, merged = self._generate(req, request_id)
        return self._events(req, request_id, prompts, merged)

    async def _events(self, req, request_id, prompts, merged) -> AsyncIterator[str]:
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # text emitted so far per choice: logprobs' text_offset
        completion_tokens = 0
        try:
            async for i, out in merged:
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    index = i * req.n + c.index
                    text = c.text
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = self.tokenizer.decode(prompts[i]) + text
                    offset = offsets.get(index, 0) + len(text) - len(c.text)
                    offsets[index] = offset + len(c.text)
                    choice = CompletionChoice(index=index, text=text, finish_reason=c.finish_reason,
                                              logprobs=self._logprobs(req, c, offset),
                                              **self._token_ids(req, prompts[i], c.token_ids))
                    chunk = CompletionResponse(id=request_id, model=req.model, choices=[choice])
                    yield f"data: {chunk.model_dump_json()}\n\n"
            if req.stream_usage:
                usage = Usage.of(sum(map(len, prompts)), completion_tokens)
                chunk = CompletionResponse(id=request_id, model=req.model, choices=[], usage=usage)
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # noqa: BLE001 - headers are sent: reported in-band (DESIGN §6)
            yield stream_error_event(exc)
        yield "data: [DONE]\n\n"


def stream_error_event(exc: Exception) -> str:
    """An error after the response began: sent in-band, before [DONE] (DESIGN §6)."""
    msg = str(exc) if isinstance(exc, (*CLIENT_ERRORS, ServerError)) else "internal server error"
    return f"data: {json.dumps({'error': {'message': msg, 'type': 'server_error'}})}\n\n"
