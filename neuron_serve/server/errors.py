"""One error type carrying an HTTP status, and the handlers that render OpenAI error bodies."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from vllm.exceptions import VLLMClientError

from neuron_serve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class ServerError(Exception):
    """An error meant for the client: `message` is shown as is, so keep internals out of it."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers


# What vLLM raises for a bad request (the engine's own validation): the client's fault.
CLIENT_ERRORS = (ValueError, VLLMClientError)


def client_error(exc: Exception) -> ServerError:
    """A vLLM validation failure as a 400 naming the parameter when vLLM says which."""
    return ServerError(str(exc), param=getattr(exc, "parameter", None))


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    err_type = "invalid_request_error" if status < 500 else "server_error"
    info = ErrorInfo(message=message, type=err_type, param=param, code=int(status))
    return ErrorResponse(error=info).model_dump()


def _respond(message: str, status: HTTPStatus, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def register_error_handlers(app: FastAPI) -> None:
    """Framework errors → 400, our errors → their status, anything else → bare 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return _respond(f"{param or 'request'}: {first.get('msg', 'invalid request')}",
                        HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:  # bad JSON, 404, 405
        return _respond(str(exc.detail), HTTPStatus(exc.status_code), headers=exc.headers)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError) -> JSONResponse:
        return _respond(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(VLLMClientError)
    async def _vllm_client_error(_: Request, exc: VLLMClientError) -> JSONResponse:
        err = client_error(exc)
        return _respond(err.message, err.status, err.param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _respond("internal server error", HTTPStatus.INTERNAL_SERVER_ERROR)
