"""The OpenAI endpoints: vLLM's own serving classes behind our lifecycle layer.

vLLM's `OpenAIServingCompletion`, `OpenAIServingChat` and `OpenAIServingResponses` do the
rendering (chat templates, tools), the request → SamplingParams mapping (structured
outputs, logprobs, prompt logprobs), the tool and reasoning parsers and the response
shapes; they are built by vLLM's own `init_app_state`, from vLLM's frontend flags. This
module runs them under our rules: a request may take `--request-timeout`, a client that
leaves aborts its request, errors are OpenAI-shaped (ours: errors.py), and every body and
stream chunk is brought to the shape of OpenAI's published schema where vLLM's differs
(conform_* below).
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import State
from vllm.engine.protocol import EngineClient
from vllm.entrypoints.serve.engine.protocol import ErrorResponse as VllmErrorResponse

from neuron_serve.server.errors import ServerError, as_server_error, error_body

CLIENT_DISCONNECTED = 499  # nginx's code: logged, never seen by the (gone) client


async def init_serving(engine: EngineClient, args: Namespace, state: State) -> None:
    """vLLM's serving objects on `state`, as `vllm serve` builds them."""
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    args.structured_outputs_config = engine.vllm_config.structured_outputs_config
    await init_app_state(engine, state, args, await engine.get_supported_tasks())


# ---- vLLM's results → responses ----------------------------------------------------------


async def respond(request: Request, work: Awaitable, timeout_s: float | None,
                  conform: Callable[[dict], dict]) -> Response:
    """Await a vLLM serving call and answer with its result: an error, a body, or a
    server-sent event stream (closing it aborts the request in the engine)."""
    try:
        result = await _unless_disconnected(request, _within_s(work, timeout_s))
    except Exception as exc:
        # As a ServerError, the error is answered without Starlette re-raising it; a re-raise
        # makes uvicorn close the keep-alive connection unannounced, failing the client's
        # next request on it.
        raise as_server_error(exc) from exc
    if isinstance(result, Response):
        return result
    if isinstance(result, VllmErrorResponse):
        err = result.error
        raise ServerError(err.message, HTTPStatus(err.code), err.param)
    if isinstance(result, BaseModel):
        return JSONResponse(conform(result.model_dump(mode="json", by_alias=True)))
    return EventStream(_events(result, timeout_s, conform))


async def _within_s(work: Awaitable, seconds: float | None):
    if seconds is None:
        return await work
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:  # cancelling it aborts the request (vLLM answers that with an error body)
        task.cancel()
        await asyncio.wait({task})
        raise _timed_out(seconds)
    return task.result()


def _timed_out(seconds: float) -> ServerError:
    return ServerError(f"the request did not finish within {seconds:g} s (--request-timeout)",
                       HTTPStatus.GATEWAY_TIMEOUT)


async def _unless_disconnected(request: Request, work: Awaitable):
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
            await asyncio.wait({task})  # the cancellation lands: the request is aborted
    if watch.done() and not watch.cancelled():  # the client left, whatever the task said
        return Response(status_code=CLIENT_DISCONNECTED)
    return task.result()


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


async def _events(stream: AsyncIterator, timeout_s: float | None,
                  conform: Callable[[dict], dict]) -> AsyncIterator[str]:
    """vLLM's stream (SSE strings, or the Responses API's event objects) with each JSON
    payload conformed; a timeout or failure after the headers went out is reported
    in-band, then [DONE] (DESIGN §6). Closing this closes vLLM's stream."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    done = False
    try:
        while True:
            try:
                item = await asyncio.wait_for(
                    anext(stream), None if deadline is None else deadline - loop.time())
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise _timed_out(timeout_s) from None
            if isinstance(item, BaseModel):  # a Responses API event
                payload = conform(item.model_dump(mode="json", by_alias=True))
                yield f"event: {payload.get('type', 'message')}\ndata: {json.dumps(payload)}\n\n"
                continue
            for line in item.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield f"data: {json.dumps(conform(json.loads(line[6:])))}\n\n"
                elif line == "data: [DONE]":
                    done = True
                    yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - headers are sent: reported in-band
        err = as_server_error(exc)
        yield f"data: {json.dumps(error_body(err.message, err.status, err.param))}\n\n"
        if not done:
            yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


# ---- vLLM's shapes → OpenAI's published schema ------------------------------------------


def conform_error(body: dict) -> dict:
    """vLLM reports an error inside a stream with an integer `code`; OpenAI's is a string."""
    if isinstance(body.get("error"), dict) and isinstance(body["error"].get("code"), int):
        status = HTTPStatus(body["error"]["code"])
        return error_body(body["error"].get("message", status.phrase), status,
                          body["error"].get("param"))
    return body


def _usage(body: dict) -> dict:
    """OpenAI's usage details are objects when present; vLLM sends null for absent ones."""
    usage = body.get("usage")
    if isinstance(usage, dict):
        for key in ("prompt_tokens_details", "completion_tokens_details"):
            if usage.get(key) is None:
                usage.pop(key, None)
    return body


def conform_completion(body: dict) -> dict:
    return conform_error(_usage(body))


def conform_chat(body: dict) -> dict:
    """`finish_reason` and `refusal` are required (nullable) by OpenAI's chat schemas; vLLM
    leaves them out when unset."""
    for choice in body.get("choices") or ():
        choice.setdefault("finish_reason", None)
        if isinstance(choice.get("message"), dict):
            message = choice["message"]
            message.setdefault("refusal", None)
            for key in ("function_call", "audio", "annotations", "tool_calls"):  # objects or absent
                if message.get(key) is None:
                    message.pop(key, None)
        if isinstance(choice.get("logprobs"), dict):
            choice["logprobs"].setdefault("refusal", None)
        for call in (choice.get("delta") or {}).get("tool_calls") or ():
            _drop_nulls(call)  # a call's later deltas carry arguments only
            _drop_nulls(call.get("function") or {})
    return conform_error(_usage(body))


def _drop_nulls(fields: dict) -> None:
    for key in [k for k, v in fields.items() if v is None]:
        del fields[key]


def conform_response(body: dict) -> dict:
    return conform_error(body)
