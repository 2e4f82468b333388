"""``generate()``: a list of prompts run to completion on an engine's own step loop.

Kept apart from :mod:`cbcore.engine_core` so the engine file holds the step
loop alone; this is the batch convenience on top of ``add_request``/``step``:
per-prompt arguments, refused prompts as error outputs, and aborting the
call's requests if a step raises so the engine stays reusable.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from cbcore.log import get_logger
from cbcore.outputs import RequestOutput
from cbcore.request_checks import Prompt, RequestError, encode_prompt
from cbcore.scheduling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cbcore.engine_core import EngineCore

log = get_logger(__name__)


def run_batch(
    core: EngineCore,
    prompts: Seq[Prompt],
    params: SamplingParams | Seq[SamplingParams] | None = None,
    *,
    priorities: int | Seq[int] | None = None,
    client_ids: str | Seq[str] | None = None,
    deadlines_s: float | Seq[float | None] | None = None,
    attrs: Mapping[str, Any] | Seq[Mapping[str, Any] | None] | None = None,
    progress: bool = False,
) -> list[RequestOutput]:
    """Run ``prompts`` to completion; outputs come back in prompt order.

    Each per-request argument is one value for every prompt or a list with
    one per prompt. A prompt that is refused (empty, too long, can never
    fit the KV cache, a bad field) yields an output with
    ``finish_reason="error"`` and the reason in ``error``; the other
    prompts run normally. If a step raises (a scheduler plugin's error,
    say), every request of this call is aborted before the exception
    propagates, so the engine is idle and reusable.
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        raise TypeError("generate() takes a list of prompts (strings or token-id lists)")
    if core.has_unfinished():
        raise RuntimeError("generate() needs an idle engine; drive pending requests with step()")
    n = len(prompts)
    per_prompt = _expand(params, n, "params", SamplingParams, SamplingParams())
    prios = _expand(priorities, n, "priorities", int, 0)
    clients = _expand(client_ids, n, "client_ids", str, "default")
    deadlines = _expand(deadlines_s, n, "deadlines_s", int | float, None)
    extras = _expand(attrs, n, "attrs", Mapping, None)
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    try:
        for i, prompt in enumerate(prompts):
            request_id = core.new_request_id()
            ids.append(request_id)
            try:
                core.add_request(
                    prompt,
                    per_prompt[i],
                    request_id=request_id,
                    priority=prios[i],
                    client_id=clients[i],
                    deadline_s=deadlines[i],
                    attrs=extras[i],
                )
            except RequestError as exc:
                log.warning("request rejected", request_id=request_id, error=str(exc))
                prompt_ids = prompt if isinstance(prompt, list) else []
                done[request_id] = RequestOutput.rejected(request_id, list(prompt_ids), str(exc))
        bar = _progress(progress, len(ids) - len(done))
        last: dict[str, RequestOutput] = {}  # each request's latest delta, for one aborted meanwhile
        while core.has_unfinished():
            for output in core.step():
                last[output.request_id] = output
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
        bar.close()
        for i, request_id in enumerate(ids):
            if request_id not in done:  # aborted outside the loop, by a step listener say: it ends here
                done[request_id] = _aborted(core, request_id, prompts[i], last.get(request_id))
    except BaseException:
        for request_id in ids:
            if request_id not in done:
                try:
                    core.abort(request_id)
                except Exception as exc:  # the first error is the one to report
                    log.error("abort failed", request_id=request_id, error=str(exc))
        raise
    return [done[i] for i in ids]


def _aborted(core: EngineCore, request_id: str, prompt: Prompt, last: RequestOutput | None) -> RequestOutput:
    """The final output of a request that ended by ``abort()`` (which yields no output of its own)."""
    if last is not None:
        prompt_ids, output_ids = list(last.prompt_token_ids), list(last.output_token_ids)
    else:
        prompt_ids, output_ids = encode_prompt(prompt, request_id, core.tokenizer), []
    return RequestOutput(request_id, prompt_ids, output_ids, [], True, "abort")


def _expand(value: Any, n: int, what: str, single: Any, default: Any) -> list[Any]:
    """One value per prompt from ``value``: None (the default), one value, or a list of ``n``."""
    if value is None:
        return [default] * n
    if isinstance(value, single):  # a wrong type is refused per request by add_request
        return [value] * n
    if isinstance(value, str | bytes | Mapping):
        raise TypeError(f"{what}: expected one value or a list of {n}, got {type(value).__name__}")
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{what}: got {len(value)} values for {n} prompts")
    return value


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="generate")


class _NoBar:
    def update(self, n: int) -> None: ...
    def close(self) -> None: ...
