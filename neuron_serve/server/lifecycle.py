"""What sits in front of every route: request ids and JSON access logs, API keys, body
size, admission control, and draining on SIGTERM.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware: streamed responses
pass through untouched, and a request counts as in flight until its last byte is sent.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import uvicorn

from neuron_serve.server.errors import error_body

access_log = logging.getLogger("neuron_serve.access")


def _json_lines_to_stdout() -> None:
    """Access lines are bare JSON objects, one per line, for log shippers."""
    if not access_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False

OPEN_PATHS = {"/health", "/ready", "/metrics", "/version"}  # probes and scrapers: no key
ADMITTED_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}  # count against the limit
RETRY_AFTER_S = "1"
LOST_ENGINE_EXIT_S = 2.0  # probes and load balancers see 503 before the process goes


@dataclass(frozen=True)
class ServerLimits:
    api_keys: tuple[str, ...] = ()
    max_queued_requests: int | None = None  # generation requests in flight; more get 429
    max_request_body_bytes: int = 10 << 20
    drain_timeout_s: float = 30.0


class Lifecycle:
    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits
        _json_lines_to_stdout()
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        start, status = time.monotonic(), [0]

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self._route(scope, headers, receive, send_with_id)
        finally:
            access_log.info(json.dumps({
                "request_id": request_id, "method": scope["method"], "path": scope["path"],
                "status": status[0], "ms": round(1000 * (time.monotonic() - start), 1),
                "client": (scope.get("client") or ["?"])[0]}))

    async def _route(self, scope, headers, receive, send) -> None:
        path = scope["path"]
        if self.draining and path == "/ready":
            return await _reject(send, HTTPStatus.SERVICE_UNAVAILABLE, "the server is draining")
        if path not in OPEN_PATHS and self.limits.api_keys and not self._authorized(headers):
            return await _reject(send, HTTPStatus.UNAUTHORIZED,
                                 "missing or wrong API key: send 'Authorization: Bearer <key>'")
        if self.draining and path not in OPEN_PATHS:
            return await _reject(send, HTTPStatus.SERVICE_UNAVAILABLE,
                                 "the server is shutting down; retry on another replica",
                                 retry_after=True)
        length = int(headers.get("content-length") or 0)
        if length > self.limits.max_request_body_bytes:
            return await _reject(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                 f"request body of {length} bytes exceeds the limit of "
                                 f"{self.limits.max_request_body_bytes} (--max-request-body-bytes)")
        if path not in ADMITTED_PATHS:
            return await self.app(scope, receive, send)
        limit = self.limits.max_queued_requests
        if limit is not None and self.in_flight >= limit:
            return await _reject(send, HTTPStatus.TOO_MANY_REQUESTS,
                                 f"{self.in_flight} requests in flight, the limit is {limit} "
                                 "(--max-queued-requests); retry later", retry_after=True)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # Compare against every key, always: the time taken says nothing about which matched.
        matches = [hmac.compare_digest(token.encode(), key.encode()) for key in self.limits.api_keys]
        return scheme.lower() == "bearer" and any(matches)

    async def drain(self) -> None:
        """Stop admitting; wait for in-flight requests, at most the drain timeout."""
        self.draining = True
        deadline = time.monotonic() + self.limits.drain_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            access_log.warning("drain timeout: %d requests still in flight", self.in_flight)


async def _reject(send, status: HTTPStatus, message: str, retry_after: bool = False) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", RETRY_AFTER_S.encode()))
    await send({"type": "http.response.start", "status": int(status), "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains before shutting down and the
    process then exits 0 (uvicorn would re-raise the signal); a second signal exits at once.

    Once a second it asks `engine_lost` why the engine is gone (None: it is not): an engine
    that stopped (a rank died, a node vanished) is not coming back, so the server stops
    admitting and shuts down, and `engine_failed` tells the caller to exit non-zero for the
    supervisor to restart it."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle,
                 engine_lost: Callable[[], str | None] = lambda: None):
        super().__init__(config)
        self.lifecycle, self.engine_lost = lifecycle, engine_lost
        self.engine_failed = False

    def handle_exit(self, sig, frame) -> None:
        if self.lifecycle.draining:
            return super().handle_exit(sig, frame)
        self.lifecycle.draining = True
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit(sig, frame)))

    async def _drain_then_exit(self, sig, frame) -> None:
        await self.lifecycle.drain()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s
        if counter % 10 == 0 and not self.engine_failed and (why := self.engine_lost()):
            access_log.error("%s: shutting down in %g s, exit status 1", why, LOST_ENGINE_EXIT_S)
            self.engine_failed = self.lifecycle.draining = True
            asyncio.get_running_loop().call_later(LOST_ENGINE_EXIT_S, self._exit)
        return await super().on_tick(counter)

    def _exit(self) -> None:
        self.should_exit = True
