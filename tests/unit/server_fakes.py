"""Stand-ins for the server's unit tests: an engine client (only what our own layer calls:
model_config, get_tokenizer, generate, abort, check_health, collective_rpc), with a real
tokenizer and real vLLM output objects, and serving objects with vLLM's calling convention
(`create_completion(request, raw_request)` → a body, an SSE generator, or vLLM's
ErrorResponse) over it, put on the app by `stand_in_serving`. They exercise what
neuron-serve owns (lifecycle, timeouts, disconnects, error shapes, probes, metrics,
profiling); vLLM's serving itself runs in tests/e2e on real engines.

Generation is deterministic and trivial: choice c of a prompt of L tokens emits the word
tokens word_ids[L + c], word_ids[L + c + 1], ... (`continuation`), max_tokens of them, then
finish_reason "length". Streamed requests (RequestOutputKind.DELTA) get one output per
token and choice; others get one final output with every choice. A generator closed or
cancelled early aborts its request, as AsyncLLM.generate does.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ConfigDict
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineGenerateError

from neuron_serve.models.corpus import topic_documents
from neuron_serve.models.tokenizer import save_hf_tokenizer, train_bpe

MAX_MODEL_LEN = 128
SERVED = "tiny"
VOCAB = 512


def make_tokenizer(directory: Path):
    """A byte-level BPE with our chat template, saved and loaded the way vLLM loads one."""
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    save_hf_tokenizer(train_bpe(topic_documents().values(), VOCAB), directory, MAX_MODEL_LEN)
    return get_cached_tokenizer(AutoTokenizer.from_pretrained(directory))


class StandInEngine:
    """Records every request (`requests`: prompt ids and SamplingParams by request id).
    `hold`, an asyncio.Event, keeps generations before their first output until it is set
    (it binds to the loop that first waits on it: one loop per test). `fail_after` raises
    vLLM's EngineGenerateError after that many outputs, as AsyncLLM does when its
    generation fails."""

    def __init__(self, tokenizer, max_model_len: int = MAX_MODEL_LEN):
        self.model_config = SimpleNamespace(max_model_len=max_model_len, model="/models/tiny",
                                            served_model_name="tiny")
        # One data-parallel engine, as vLLM's client names it.
        self.engine_core = SimpleNamespace(core_engines=[(0).to_bytes(2, "little")],
                                           call_utility_all_async=self._on_every_engine)
        self.tokenizer = tokenizer
        self.word_ids = sorted(i for i in range(len(tokenizer))
                               if re.fullmatch(r" [a-z]{3,}", tokenizer.decode([i])))
        self.hold: asyncio.Event | None = None
        self.fail_after: int | None = None
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.rpc_calls: list[tuple[str, tuple]] = []
        self.rpc_results: dict[str, list] = {"graph_stats": []}  # shape-free: no ranks

    def get_tokenizer(self):
        return self.tokenizer

    async def check_health(self) -> None:
        pass

    async def abort(self, request_id) -> None:
        self.aborted.append(request_id)

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        self.rpc_calls.append((method, args))
        return self.rpc_results.get(method, [None])

    async def _on_every_engine(self, utility: str, method: str, timeout, args, kwargs) -> list:
        assert utility == "collective_rpc"
        return [await self.collective_rpc(method, timeout, args, kwargs)]

    async def wait_for_running(self, n: int, timeout: float = 5.0) -> None:
        """Until `n` generations have been submitted and not finished."""
        async with asyncio.timeout(timeout):
            while len(self.running) < n:
                await asyncio.sleep(0.005)

    def continuation(self, prompt: list[int], choice: int, count: int) -> list[int]:
        start = len(prompt) + choice
        return [self.word_ids[(start + k) % len(self.word_ids)] for k in range(count)]

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, **_):
        ids = list(prompt["prompt_token_ids"])
        self.requests[request_id] = (ids, sampling_params)
        self.running.add(request_id)
        try:
            if self.hold is not None:
                await self.hold.wait()
            for sent, out in enumerate(self._outputs(request_id, ids, sampling_params)):
                if self.fail_after is not None and sent >= self.fail_after:
                    raise EngineGenerateError() from RuntimeError("worker failed")
                yield out
                await asyncio.sleep(0)
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)
            raise
        finally:
            self.running.discard(request_id)

    def _outputs(self, request_id: str, prompt: list[int], params: SamplingParams):
        n, length = params.n, params.max_tokens
        tokens = [self.continuation(prompt, c, length) for c in range(n)]
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            yield self._request_output(request_id, prompt, [
                self._completion(c, tokens[c], 0, length, params) for c in range(n)], True)
            return
        for step in range(length):
            for c in range(n):
                done = step == length - 1
                yield self._request_output(request_id, prompt, [
                    self._completion(c, tokens[c], step, step + 1, params)], done and c == n - 1)

    def _completion(self, index: int, tokens: list[int], start: int, end: int,
                    params: SamplingParams) -> CompletionOutput:
        text = self.tokenizer.decode(tokens[:end])[len(self.tokenizer.decode(tokens[:start])):]
        new = tokens[start:end]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._step_logprobs(t, params.logprobs) for t in new]
        return CompletionOutput(index=index, text=text, token_ids=new, cumulative_logprob=None,
                                logprobs=logprobs,
                                finish_reason="length" if end == len(tokens) else None)

    def _step_logprobs(self, token: int, top: int) -> dict[int, Logprob]:
        """The sampled token's logprob, then `top` alternatives' (vLLM returns both)."""
        alternatives = [a for a in self.word_ids if a != token][:top]
        return {t: Logprob(logprob=-0.5 * rank, rank=rank,
                           decoded_token=self.tokenizer.decode([t]))
                for rank, t in enumerate([token, *alternatives], start=1)}

    @staticmethod
    def _request_output(request_id: str, prompt: list[int], outputs: list[CompletionOutput],
                        finished: bool) -> RequestOutput:
        return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt,
                             prompt_logprobs=None, outputs=outputs, finished=finished)


class StandInServing:
    """vLLM's serving classes' calling convention over the stand-in engine: the prompt (or
    the messages' contents, joined) tokenized, `max_tokens` and `n` obeyed, the output text
    returned. Streams close the engine's generator when they end, as vLLM's do."""

    def __init__(self, engine: StandInEngine, served: list[str]):
        self.engine, self.served = engine, served

    async def create_completion(self, req, raw_request):
        return await self._generate(req, req.prompt, req.max_tokens or 16)

    async def create_chat_completion(self, req, raw_request):
        text = " ".join(m["content"] for m in req.messages)
        return await self._generate(req, text, req.max_completion_tokens or req.max_tokens or 16)

    async def _generate(self, req, text: str, max_tokens: int):
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

        if req.model not in self.served:
            return ErrorResponse(error=ErrorInfo(message=f"model {req.model!r} does not exist",
                                                 type="NotFoundError", param="model", code=404))
        ids = self.engine.tokenizer.encode(text)
        params = SamplingParams(n=req.n or 1, max_tokens=max_tokens, output_kind=(
            RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY))
        outputs = self.engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex)
        if req.stream:
            return self._events(req, outputs)
        final = None
        async for out in outputs:
            final = out
        return StandInBody(model=req.model, choices=[
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}
            for c in final.outputs])

    @staticmethod
    async def _events(req, outputs):
        try:
            async for out in outputs:
                for c in out.outputs:
                    chunk = {"model": req.model, "choices": [
                        {"index": c.index, "text": c.text, "finish_reason": c.finish_reason}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
        except EngineGenerateError:  # as vLLM's streams report it: in-band, integer code
            error = {"message": "internal server error", "type": "InternalServerError", "code": 500}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    async def create_tokenize(self, req, raw_request):
        tokens = self.engine.tokenizer.encode(req.prompt)
        return StandInBody(count=len(tokens), tokens=tokens)

    async def show_available_models(self):
        return StandInBody(object="list", data=[{"id": name, "object": "model"}
                                                 for name in self.served])


class StandInBody(BaseModel):
    model_config = ConfigDict(extra="allow")


def stand_in_serving(engine: StandInEngine, served: list[str]):
    """An `init` for build_app: the stand-in serving objects on the app's state."""
    async def init(_engine, _args, state) -> None:
        serving = StandInServing(engine, served)
        state.openai_serving_completion = state.openai_serving_chat = serving
        state.openai_serving_models = state.serving_tokenization = serving
    return init


async def stand_in_app(engine: StandInEngine, served: list[str] = (SERVED,), **kw):
    from neuron_serve.server.app import build_app

    return await build_app(engine, SimpleNamespace(), init=stand_in_serving(engine, list(served)),
                           **kw)


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of a server-sent-events body, checking its framing: every event
    is exactly one `data: ...` line followed by a blank line."""
    assert body.endswith("\n\n"), body[-200:]
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def sse_chunks(body: str) -> list[dict]:
    """The JSON events of a stream that ends with `data: [DONE]` (and only there)."""
    events = sse_events(body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events
    return [json.loads(e) for e in events[:-1]]


# Fixtures the server test modules import: one tokenizer per module, a fresh engine per test.
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def engine(tokenizer):
    return StandInEngine(tokenizer)
