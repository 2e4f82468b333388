"""OpenAI-style error bodies, for our own refusals and for FastAPI's validation errors."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cbcore.serve.protocol import ErrorBody, ErrorResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}


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
        kind = ERROR_TYPES.get(self.status, "server_error")
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
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', msg)}")
    param = loc[0] if loc else None
    return ApiError(400, f"{'.'.join(loc)}: {msg}" if loc else msg, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()
