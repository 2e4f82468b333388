"""Running one workload against a server over HTTP, with streaming clients.

Each request is its own client task that waits for its arrival offset, then
streams ``/v1/completions`` with the workload's token ids as the prompt
(greedy, ``return_token_ids``), and timestamps every chunk as it is read. The
result is the same :class:`RunResult` the in-process driver returns, so the
metrics, the reference check and the report are the benchmark's own: TTFT,
ITL and e2e are what a client sees, wire and server included. The server is
`cb serve` or vLLM (``/v1/models`` says which: the per-request fields go
where each reads them, :func:`request_body`), so one trace compares both.
Each run starts with the server's prefix cache emptied (:func:`empty_prefix_cache`), and the
tokens each prompt found cached come back in its usage (``cached_tokens``: the row's prefix hit rate).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence as Seq
from typing import Any

from cbcore.bench.driver import ProgressFactory, RunResult, no_progress
from cbcore.bench.workload import BenchRequest, Workload, thaw
from cbcore.log import get_logger
from cbcore.outputs import RequestMetrics, RequestOutput

log = get_logger(__name__)


def run_http(
    url: str,
    name: str,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    *,
    api_key: str | None = None,
    progress: ProgressFactory = no_progress,
) -> RunResult:
    """Drive the server at ``url`` (``http://host:port``) with ``workload``; outputs in workload order."""
    return asyncio.run(_run(url.rstrip("/"), name, workload, token_ids, api_key, progress))


async def _run(
    url: str,
    name: str,
    workload: Workload,
    token_ids: Seq[Seq[int]],
    api_key: str | None,
    progress: ProgressFactory,
) -> RunResult:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n = len(workload.requests)
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as http:
        models = (await http.get("/v1/models")).raise_for_status().json()
        model = models["data"][0]["id"]
        dialect = server_dialect(models["data"][0].get("owned_by"), workload)
        first = tuple(token_ids[0][:8])
        warm = BenchRequest(request_id="warm-up", arrival_s=0.0, max_new_tokens=4, prompt_token_ids=first, ignore_eos=True)
        await _one(http, model, warm, list(token_ids[0][:8]), time.perf_counter(), dialect)
        kept = await empty_prefix_cache(http, url)
        bar = progress(n, name)
        start = time.perf_counter()

        answers: dict[str, asyncio.Future[RequestOutput]] = {
            r.request_id: asyncio.get_running_loop().create_future() for r in workload.requests
        }

        async def tracked(req: BenchRequest, ids: list[int]) -> RequestOutput:
            t0 = start
            if req.follows is not None:  # a closed-loop turn: sent arrival_s after the answer it continues
                before = await answers[req.follows]
                done_at = before.metrics.finish_time if before.metrics else None
                t0 = done_at if done_at is not None else time.perf_counter()
                ids = list(before.prompt_token_ids) + list(before.output_token_ids) + ids
            out = await _one(http, model, req, ids, t0, dialect)
            answers[req.request_id].set_result(out)
            bar.update(1)
            return out

        outputs = await asyncio.gather(
            *(tracked(r, list(ids)) for r, ids in zip(workload.requests, token_ids, strict=True))
        )
        duration = time.perf_counter() - start
        bar.close()
    return RunResult(
        name=name, kind="cbcore", outputs=list(outputs), duration_s=duration,
        info={"server": url, "dialect": dialect, "prefix_cache_kept": kept},
    )


async def empty_prefix_cache(http: Any, url: str) -> str | None:
    """Empty the server's prefix cache; None, or why it is kept (the row says so).

    Every run should start cold, as an in-process row's fresh engine does: a
    server keeps its cache between runs (``--repeat``, a second row on the same
    server, an earlier benchmark), and a run that finds its prompts cached
    measures something else. vLLM serves the endpoint only in development mode
    and refuses while blocks are held, so it is asked again for a while.
    """
    for _ in range(50):
        resp = await http.post("/reset_prefix_cache")
        if resp.status_code in (404, 405, 501):
            why = f"POST /reset_prefix_cache: HTTP {resp.status_code}"
            if resp.status_code != 501:
                why += " (vLLM serves it with VLLM_SERVER_DEV_MODE=1)"
            log.warning("the server's prefix cache is kept: a run may find earlier prompts cached", server=url, why=why)
            return why
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: POST /reset_prefix_cache: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.json().get("success", True):
            return None
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} refused to empty its prefix cache for 5 s (blocks still held by other clients?)")


#: How each server family takes the per-request scheduling fields (OpenAI has only ``user``).
DIALECTS = ("cbcore", "vllm")


def server_dialect(owned_by: object, workload: Workload) -> str:
    """``cbcore`` or ``vllm``, from what ``/v1/models`` says owns the model.

    Any other server gets the plain OpenAI body, which cannot carry priority,
    deadline or attrs: a workload that sets them is refused rather than run
    without them.
    """
    if owned_by in DIALECTS:
        return str(owned_by)
    fields = sorted(
        {f for r in workload.requests for f, on in
         (("priority", r.priority != 0), ("deadline_s", r.deadline_s is not None), ("attrs", bool(r.attrs))) if on}
    )  # fmt: skip
    if fields:
        raise ValueError(
            f"the server's models are owned by {owned_by!r}, not one of {', '.join(DIALECTS)}: it has no way to "
            f"receive the workload's {', '.join(fields)}; drop them from the workload to drive it anyway"
        )
    return "openai"


def request_body(model: str, req: BenchRequest, ids: list[int], dialect: str = "cbcore") -> dict[str, Any]:
    """One streamed completion; the scheduling fields where the server's dialect reads them.

    vLLM takes ``priority`` itself (with ``--scheduling-policy priority``) and
    the rest through ``vllm_xargs`` (its ``SamplingParams.extra_args``), which
    is where ``cbcore_vllm`` reads them; its values are scalars, so ``attrs``
    travels as JSON text.
    """
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": req.max_new_tokens,
        "temperature": 0.0,
        "ignore_eos": req.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},  # its prompt_tokens_details: the tokens found cached
        "return_token_ids": True,
        "user": req.client_id,
    }
    if dialect == "cbcore":
        body["priority"] = req.priority
        if req.deadline_s is not None:
            body["deadline_s"] = req.deadline_s
        if req.attrs:
            body["attrs"] = thaw(req.attrs)
    elif dialect == "vllm":
        body["priority"] = req.priority
        xargs: dict[str, Any] = {"client_id": req.client_id}
        if req.deadline_s is not None:
            xargs["deadline_s"] = req.deadline_s
        if req.attrs:
            xargs["attrs"] = json.dumps(thaw(req.attrs))
        body["vllm_xargs"] = xargs
    return body


async def _one(
    http: Any, model: str, req: BenchRequest, ids: list[int], start: float, dialect: str
) -> RequestOutput:
    arrival = start + req.arrival_s
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    tokens: list[int] = []
    times: list[float] = []
    finish: str | None = None
    error: str | None = None
    cached: int | None = None  # None: the server does not say
    async with http.stream("POST", "/v1/completions", json=request_body(model, req, ids, dialect)) as resp:
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message", "error event")
                    break
                now = time.perf_counter()
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens", cached)
                for choice in chunk["choices"]:
                    new = choice.get("token_ids") or []
                    tokens.extend(new)
                    times.extend([now] * len(new))
                    finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    if error is not None:
        return RequestOutput.rejected(req.request_id, ids, error)
    metrics = RequestMetrics(
        arrival_time=arrival,
        first_scheduled_time=None,  # not visible from outside the server
        first_token_time=times[0] if times else None,
        token_times=tuple(times),
        finish_time=end,
        num_preemptions=0,
        prompt_len=len(ids),
        output_len=len(tokens),
        prefix_cache_queries=0 if cached is None else len(ids),
        prefix_cache_hits=cached or 0,
    )
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=ids,
        output_token_ids=tokens,
        new_token_ids=[],
        finished=True,
        finish_reason=finish,
        metrics=metrics,
    )
