"""The FastAPI application around one engine: state, lifespan, health and metrics routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from cbcore.engine import Engine
from cbcore.serve import errors
from cbcore.serve.config import ServeConfig
from cbcore.serve.convert import Limits
from cbcore.serve.engine_loop import EngineLoop
from cbcore.serve.errors import ApiError
from cbcore.serve.guard import RequestGuard
from cbcore.serve.metrics import CONTENT_TYPE, ServerMetrics, policy_label
from cbcore.serve.state import ServerState


def build_app(
    engine: Engine, tokenizer: Any, model_name: str, settings: ServeConfig, api_key: str | None = None
) -> FastAPI:
    """The app; the engine thread starts with it and stops (aborting what is left) when it stops."""
    metrics = ServerMetrics(model_name, policy_label(engine.config))
    engine.step_listeners.append(metrics.on_step)
    loop = EngineLoop(engine, observers=[metrics.observe], abort_listeners=[metrics.finished],
                      stall_listeners=[metrics.stalled], watchdog_s=settings.watchdog_s)  # fmt: skip
    metrics.on_load(loop.load)
    return make_app(ServerState(loop, tokenizer, model_name, Limits.of(engine), settings, metrics, api_key))


def make_app(state: ServerState) -> FastAPI:
    """The routes around any engine loop: this process's own, or replicas elsewhere (cbcore.scale)."""
    from cbcore.serve.routes import api

    loop, settings, metrics = state.loop, state.settings, state.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop.stop()
            state.prompts.close()

    app = FastAPI(title="cbcore", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.cb = state
    errors.install(app)
    app.include_router(api)
    # The key and the body limit, before any route reads or parses the body.
    app.add_middleware(
        RequestGuard,
        api_key=state.api_key,
        protect_metrics=settings.protect_metrics,
        max_body_bytes=state.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )

    @app.get("/health")
    async def health() -> JSONResponse:
        if (trouble := loop.trouble) is not None:  # stopped after a failure, stalled, or no engine thread
            return JSONResponse({"status": trouble}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """vLLM's endpoint (its development mode): a benchmark's run must not find an earlier run's prompts cached."""
        if (trouble := loop.trouble) is not None:
            raise ApiError(503, trouble)
        return JSONResponse({"success": True, "freed_blocks": await loop.reset_prefix_cache()})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
