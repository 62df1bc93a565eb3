"""One error type carrying an HTTP status, and the handlers that render OpenAI error bodies."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from neuron_serve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


ENGINE_STOPPED = "the engine has stopped; the server is exiting, retry on another replica"


class ServerError(Exception):
    """An error meant for the client: `message` is shown as is, so keep internals out of it."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.headers = message, status, param, headers


def as_server_error(exc: Exception) -> ServerError:
    """Any exception as the error the client sees, classified as vLLM's server does (its
    validation errors and raw ValueErrors are the client's: 400 naming the parameter where
    vLLM says which); a server-side failure says nothing of its internals."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, ServerError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServerError(ENGINE_STOPPED, HTTPStatus.SERVICE_UNAVAILABLE)
    info = create_error_response(exc).error
    status = HTTPStatus(info.code)
    if status >= HTTPStatus.INTERNAL_SERVER_ERROR:
        logger.error("unhandled error", exc_info=exc)
        return ServerError("internal server error", status)
    return ServerError(info.message, status, info.param)


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    """OpenAI's error body; `code` names the status in words ("not_found"), as OpenAI's
    codes are strings."""
    err_type = "invalid_request_error" if status < 500 else "server_error"
    code = status.phrase.lower().replace(" ", "_").replace("-", "_")
    info = ErrorInfo(message=message, type=err_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()


def _respond(message: str, status: HTTPStatus, param: str | None = None,
             headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def _is_tag(part) -> bool:
    return isinstance(part, str) and any(c in part for c in "[](),")


def register_error_handlers(app: FastAPI) -> None:
    """Framework errors → 400, our errors → their status, anything else → bare 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        # pydantic's union and validator tags ("function-wrap[...]") are not fields
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_tag(p)]
        param = ".".join(loc) or None
        return _respond(f"{param or 'request'}: {first.get('msg', 'invalid request')}",
                        HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:  # bad JSON, 404, 405
        return _respond(str(exc.detail), HTTPStatus(exc.status_code), headers=exc.headers)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError) -> JSONResponse:
        return _respond(exc.message, exc.status, exc.param, exc.headers)

    # The last resort, outside the routes that answer through `respond` (which raise
    # ServerError): Starlette re-raises what this handler answered, so uvicorn then closes
    # the connection.
    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        err = as_server_error(exc)
        return _respond(err.message, err.status, err.param)
