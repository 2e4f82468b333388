"""When each workload request is sent, and with which prompt: open-loop and closed-loop arrivals.

An ordinary request is due at its arrival offset from the start of the run. A
request that ``follows`` another (the next turn of a conversation) is due
``arrival_s`` seconds after that one finished, and its prompt is the earlier
request's prompt, its output, then its own tokens; so it can only be released
once the driver reports the earlier request done (:meth:`Arrivals.finished`).
Every driver (the engine's and the baselines') feeds and reads this one
object, so all rows of a benchmark see the same closed loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from cbcore.bench.workload import BenchRequest
from cbcore.outputs import RequestOutput


class Arrivals:
    """Releases workload indices once they are due; builds the prompts of follow-up turns."""

    def __init__(self, requests: Seq[BenchRequest], start: float, token_ids: Seq[Seq[int]]) -> None:
        if len(token_ids) != len(requests):
            raise ValueError(f"{len(token_ids)} prompts for {len(requests)} requests")
        self.start = start
        self._requests = requests
        self._own = token_ids
        self._histories: dict[int, list[int]] = {}  # the prompts of follow-up turns (the others are their own)
        self._times: dict[int, float] = {}
        self._followers: dict[str, list[int]] = {}
        self._heap: list[tuple[float, int]] = []
        for i, req in enumerate(requests):
            if req.follows is None:
                self._schedule(i, start + req.arrival_s)
            else:
                self._followers.setdefault(req.follows, []).append(i)
        self._released = 0

    def _schedule(self, i: int, at: float) -> None:
        self._times[i] = at
        heapq.heappush(self._heap, (at, i))

    def due(self, now: float) -> Iterator[int]:
        """Indices whose arrival time has come, earliest first."""
        while self._heap and self._heap[0][0] <= now:
            yield self.pop()

    def pop(self) -> int:
        """The index of the earliest known arrival, taken off the queue."""
        self._released += 1
        return heapq.heappop(self._heap)[1]

    def arrival_time(self, i: int) -> float:
        return self._times[i]

    def prompt(self, i: int) -> Seq[int]:
        return self._histories[i] if i in self._histories else self._own[i]

    def finished(self, i: int, output: RequestOutput, now: float) -> None:
        """Request ``i`` is done: schedule the turns that follow it (their think time starts now)."""
        followers = self._followers.get(self._requests[i].request_id)
        if not followers:
            return
        done_at = output.metrics.finish_time if output.metrics and output.metrics.finish_time else now
        history = [*self.prompt(i), *output.output_token_ids]
        for j in followers:
            self._histories[j] = history + list(self._own[j])
            self._schedule(j, done_at + self._requests[j].arrival_s)

    @property
    def exhausted(self) -> bool:
        """Every request has been released."""
        return self._released >= len(self._requests)

    def next_time(self) -> float | None:
        """When the next known arrival is due; None while the next ones wait on requests in flight."""
        return self._heap[0][0] if self._heap else None

    def wait(self, clock: Callable[[], float], sleep: Callable[[float], None]) -> float:
        """Sleep until the next arrival; returns the time slept."""
        at = self.next_time()
        if at is None:
            raise RuntimeError("nothing is in flight, yet the remaining requests wait on one that never finished")
        delay = at - clock()
        if delay > 0:
            sleep(delay)
        return max(delay, 0.0)


def prompt_bounds(requests: Seq[BenchRequest], token_ids: Seq[Seq[int]]) -> list[int]:
    """The longest prompt each request can have (a follow-up carries its whole conversation)."""
    index = {r.request_id: i for i, r in enumerate(requests)}
    bounds: list[int] = []
    for req, own in zip(requests, token_ids, strict=True):
        before = 0
        if req.follows is not None:
            j = index[req.follows]
            before = bounds[j] + requests[j].max_new_tokens
        bounds.append(before + len(own))
    return bounds
