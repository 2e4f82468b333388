"""The endpoints: completions and chat (streamed or not), models, health, metrics.

A request is validated here, tokenised on a worker thread
(:mod:`cbcore.serve.prompts`), handed to the engine thread, and its deltas
are read from its queue as each step ends: streamed as
server-sent events, or gathered for a plain response. Whatever ends the
handler early (client gone, stop string matched, server shutting down), the
request is aborted in the engine so its KV blocks are freed before the next
step.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cbcore.outputs import RequestOutput
from cbcore.scheduling.request import RequestFields
from cbcore.serve import convert
from cbcore.serve.channel import Failed, Handle, Submission
from cbcore.serve.errors import ApiError
from cbcore.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Usage,
)
from cbcore.serve.state import ServerState
from cbcore.serve.text import TextDelta, TextStream

api = APIRouter(prefix="/v1")  # the API key is checked before the body is read: cbcore.serve.guard
DISCONNECT_POLL_S = 0.5


class RequestFailed(Exception):
    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.message)
        self.failed = failed


class Run:
    """One request in flight: its queue, its text, and the abort that ends it early."""

    def __init__(
        self, state: ServerState, handle: Handle, prompt_ids: list[int], body: ChatRequest | CompletionRequest
    ):
        self.state = state
        self.handle = handle
        self.prompt_ids = prompt_ids
        self.text = TextStream(state.tokenizer, body.stop)
        self.done = False
        self.cached_tokens = 0

    @property
    def usage(self) -> Usage:
        return Usage.of(len(self.prompt_ids), self.text.num_tokens, self.cached_tokens)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        while not self.done:
            event = await self.handle.next()
            if isinstance(event, Failed):
                self.done = True
                raise RequestFailed(event)
            assert isinstance(event, RequestOutput)
            if event.metrics is not None:  # counted over every admission (a recompute admits again): capped
                self.cached_tokens = min(event.metrics.prefix_cache_hits, len(self.prompt_ids))
            if event.finished and event.finish_reason not in ("stop", "length"):
                self.done = True
                raise RequestFailed(Failed(event.error or f"the request ended: {event.finish_reason}", 500))
            delta = self.text.push(event.new_token_ids, event.finish_reason if event.finished else None)
            if delta.finish_reason is not None:
                self.done = True
                if not event.finished:  # a stop string ended it before the engine did
                    self.state.loop.abort(self.handle.request_id, "stop")
            yield delta

    def close(self) -> None:
        """Abort in the engine unless the request already ended (client gone, shutdown)."""
        if not self.done:
            self.done = True
            self.state.loop.abort(self.handle.request_id)


def check_model(state: ServerState, body: ChatRequest | CompletionRequest) -> None:
    """First, as it costs nothing: a request for another model is not worth tokenising."""
    if body.model != state.model_name:
        raise ApiError(
            400, f"model {body.model!r} is not served here; this server serves {state.model_name!r}", "model"
        )


async def start(
    request: Request, body: ChatRequest | CompletionRequest, prompt_ids: list[int], field: str
) -> Run:
    """Validate, admit (or 503), submit, and wait for the engine to accept (or 400)."""
    state: ServerState = request.app.state.cb
    convert.check_prompt(prompt_ids, state.limits, field)
    requested = (
        body.max_completion_tokens or body.max_tokens if isinstance(body, ChatRequest) else body.max_tokens
    )
    max_field = (
        "max_completion_tokens"
        if isinstance(body, ChatRequest) and body.max_completion_tokens
        else "max_tokens"
    )
    max_tokens = convert.max_new_tokens(requested, len(prompt_ids), state.limits, max_field)
    params = convert.sampling_params(body, max_tokens)
    state.admit()
    prefix = "chatcmpl" if isinstance(body, ChatRequest) else "cmpl"
    sub = Submission(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        params=params,
        fields=RequestFields(
            priority=body.priority, client_id=body.user or "default", deadline_s=body.deadline_s, attrs=body.attrs
        ),
        arrival_time=time.perf_counter(),
    )
    run = Run(state, state.loop.submit(sub), prompt_ids, body)
    try:
        first = await run.handle.next()
    except BaseException:
        run.close()
        raise
    if isinstance(first, Failed):
        raise ApiError(first.status, first.message, field if first.status == 400 else None)
    return run


def sse(data: BaseModel | str) -> str:
    payload = data if isinstance(data, str) else data.model_dump_json()
    return f"data: {payload}\n\n"


async def stream_events(run: Run, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """SSE frames; an engine failure mid-stream becomes an ``error`` event, as OpenAI sends it."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except RequestFailed as exc:
        yield sse(ApiError(exc.failed.status, exc.failed.message).response().body.decode())
    finally:
        run.close()
    yield sse("[DONE]")


async def gather(request: Request, run: Run) -> tuple[str, list[int], str]:
    """A non-streamed request: the whole text, watching for the client hanging up meanwhile."""
    parts: list[str] = []
    ids: list[int] = []
    finish = "length"

    async def collect() -> None:
        nonlocal finish
        async for delta in run.deltas():
            parts.append(delta.text)
            ids.extend(delta.token_ids)
            finish = delta.finish_reason or finish

    task = asyncio.ensure_future(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})  # a cancelled task is done only once it has run its cancellation
                raise ApiError(499, "the client closed the connection")
        task.result()
    except RequestFailed as exc:
        raise ApiError(exc.failed.status, exc.failed.message) from None
    finally:
        if not task.done():
            task.cancel()
        run.close()
    return "".join(parts), ids[: run.text.num_tokens], finish


# -- completions -------------------------------------------------------------------


@api.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.cb
    check_model(state, body)
    prompt_ids = await state.prompts.completion(body)
    run = await start(request, body, prompt_ids, "prompt")
    rid, created, tokens = run.handle.request_id, int(time.time()), body.return_token_ids
    if body.stream:

        async def chunks() -> AsyncIterator[BaseModel]:
            first = True
            async for d in run.deltas():
                if d.text or d.finish_reason or tokens:
                    choice = CompletionChoice(
                        text=d.text, finish_reason=d.finish_reason, token_ids=d.token_ids if tokens else None
                    )
                    if first and tokens:
                        choice.prompt_token_ids = prompt_ids
                    first = False
                    usage = run.usage if body.continuous_usage else None
                    yield CompletionChunk(
                        id=rid, created=created, model=state.model_name, choices=[choice], usage=usage
                    )
            if body.include_usage:
                yield CompletionChunk(
                    id=rid, created=created, model=state.model_name, choices=[], usage=run.usage
                )

        return StreamingResponse(stream_events(run, chunks()), media_type="text/event-stream")
    text, ids, finish = await gather(request, run)
    choice = CompletionChoice(text=text, finish_reason=finish)  # type: ignore[arg-type]
    if tokens:
        choice.prompt_token_ids, choice.token_ids = prompt_ids, ids
    return JSONResponse(
        CompletionResponse(
            id=rid, created=created, model=state.model_name, choices=[choice], usage=run.usage
        ).model_dump()
    )


# -- chat ------------------------------------------------------------------------


@api.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state: ServerState = request.app.state.cb
    check_model(state, body)
    prompt_ids = await state.prompts.chat(body)
    run = await start(request, body, prompt_ids, "messages")
    rid, created, tokens = run.handle.request_id, int(time.time()), body.return_token_ids
    if body.stream:

        async def chunks() -> AsyncIterator[BaseModel]:
            def chunk(delta: Delta, finish: str | None = None, ids: list[int] | None = None) -> ChatChunk:
                choice = ChatChunkChoice(delta=delta, finish_reason=finish, token_ids=ids)  # type: ignore[arg-type]
                usage = run.usage if body.continuous_usage else None
                return ChatChunk(
                    id=rid, created=created, model=state.model_name, choices=[choice], usage=usage
                )

            yield chunk(Delta(role="assistant", content=""))
            async for d in run.deltas():
                if d.text or d.finish_reason or tokens:
                    yield chunk(Delta(content=d.text), d.finish_reason, d.token_ids if tokens else None)
            if body.include_usage:
                yield ChatChunk(id=rid, created=created, model=state.model_name, choices=[], usage=run.usage)

        return StreamingResponse(stream_events(run, chunks()), media_type="text/event-stream")
    text, ids, finish = await gather(request, run)
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)  # type: ignore[arg-type]
    if tokens:
        choice.prompt_token_ids, choice.token_ids = prompt_ids, ids
    return JSONResponse(
        ChatResponse(
            id=rid, created=created, model=state.model_name, choices=[choice], usage=run.usage
        ).model_dump()
    )


@api.get("/models")
async def models(request: Request) -> ModelList:
    state: ServerState = request.app.state.cb
    return ModelList(
        data=[ModelCard(id=state.model_name, created=state.started, max_model_len=state.limits.max_model_len)]
    )
