"""vLLM's waiting queue, ordered by cbcore's queue policy and filtered by the budget's ``may_admit``.

vLLM's scheduler admits by peeking and popping its ``RequestQueue`` until a
request does not fit (no overtaking, as in cbcore). This queue answers those
calls in the order the adapter computes once per step from the queue policy
(so time-dependent keys are re-evaluated every step), and while a step is
being scheduled it hides the requests the budget policy refuses, asking
``may_admit`` lazily in that order, as cbcore's admission loop does. Outside a
step (vLLM counting or iterating its queue) every waiting request is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request


class PolicyRequestQueue(RequestQueue):
    """A RequestQueue whose order is a function of its members, recomputed when they change."""

    def __init__(self, order: Callable[[list[Request]], list[Request]]) -> None:
        self._order_fn = order
        self._members: dict[Request, None] = {}  # insertion-ordered set
        self._ordered: list[Request] | None = None
        self._admits: Callable[[Request], bool] | None = None
        self._admitted: set[Request] = set()
        self._refused: set[Request] = set()

    # -- the adapter's side ---------------------------------------------------

    def begin_step(self, admits: Callable[[Request], bool]) -> None:
        """A new step: order afresh; until end_step(), show only what ``admits`` accepts."""
        self._ordered = None
        self._admits = admits
        self._admitted = set()
        self._refused = set()

    def end_step(self) -> None:
        self._admits = None

    def members(self) -> Iterable[Request]:
        """The waiting requests, unordered (no policy call)."""
        return self._members.keys()

    def _order(self) -> list[Request]:
        """The policy's order of the members when it was last computed (popped ones may still be in it)."""
        if self._ordered is None:
            self._ordered = self._order_fn(list(self._members))
        return self._ordered

    def ordered(self) -> list[Request]:
        """Every member in policy order (computed at most once per change of members)."""
        members = self._members
        return [r for r in self._order() if r in members]

    def _front(self) -> Request | None:
        members = self._members
        for request in self._order():
            if request not in members:  # popped since the order was computed
                continue
            if self._admits is None or request in self._admitted:
                return request
            if request in self._refused:
                continue
            if self._admits(request):
                self._admitted.add(request)
                return request
            self._refused.add(request)
        return None

    # -- vLLM's RequestQueue interface ---------------------------------------

    def add_request(self, request: Request) -> None:
        self._members[request] = None
        self._ordered = None

    def pop_request(self) -> Request:
        request = self._front()
        if request is None:
            raise IndexError("pop from an empty queue")
        del self._members[request]
        return request

    def peek_request(self) -> Request:
        request = self._front()
        if request is None:
            raise IndexError("peek from an empty queue")
        return request

    def prepend_request(self, request: Request) -> None:
        # The policy, not the position, decides where it goes (vLLM's priority queue does the same).
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        del self._members[request]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self._members.pop(request, None)

    def __bool__(self) -> bool:
        return self._front() is not None if self._admits is not None else bool(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.ordered())
