"""OpenAI-style error bodies, for our own refusals and for FastAPI's validation errors."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cbcore.serve.protocol import NEUTRAL_ONLY_ERROR, ErrorBody, ErrorResponse

ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for a status: any other 4xx is the client's request, 5xx the server."""
    return ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = error_type(self.status)
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=kind, param=self.param, code=self.status)
        ).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem, as ``field: message`` with ``param`` the top-level field."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of this API)"
    if err.get("type") == NEUTRAL_ONLY_ERROR:  # several fields at once: the first is the param
        return ApiError(400, msg, err["ctx"]["fields"][0])
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}")
    param, where = (loc[0] if loc else None), ".".join(loc)
    names_its_place = msg.startswith((f"{where}:", f"{where}.", f"{where}["))  # e.g. "attrs.a: ..."
    return ApiError(400, f"{where}: {msg}" if loc and not names_its_place else msg, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
        elif exc.status_code == 404:
            message = f"no such route: {request.method} {request.url.path}"
        return ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: answered in the API's own shape; Starlette re-raises it
        # afterwards, so the server logs its traceback.
        return ApiError(500, f"internal error: {type(exc).__name__}").response()
