"""vLLM's running list, through which cbcore's preemption policy picks the victim.

vLLM 0.32.0 chooses a victim inline in ``Scheduler.schedule()``: with its
fcfs policy it reads ``self.running[-1]`` and then ``self.running.pop()``
when a running request cannot get KV blocks. Its running loop walks the list
in order, so the request asking for room and every request after it are the
ones not yet scheduled this step -- exactly cbcore's victim candidates. This
list answers that one read (index -1 while a request is asking) with the
preemption policy's choice among those candidates, and the ``pop()`` that
follows removes that same request. Every other use is a plain list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

from vllm.v1.request import Request


class VictimList(list[Request]):
    """``running``, with ``[-1]`` / ``pop()`` answered by ``choose(candidates)`` while a request asks for room."""

    def __init__(self, items: Iterable[Request], choose: Callable[[list[Request]], Request]) -> None:
        super().__init__(items)
        self._choose = choose
        self.asking: Request | None = None  # the request whose allocate_slots() is under way
        self._victim: Request | None = None

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index == -1 and self.asking is not None and self.asking in self:
            at = next(i for i, r in enumerate(self) if r is self.asking)
            candidates = list.__getitem__(self, slice(at, None))
            # cbcore asks the policy only when there is a choice; alone, the asker is its own victim.
            self._victim = self._choose(candidates) if len(candidates) > 1 else self.asking
            return self._victim
        return super().__getitem__(index)

    def settle(self) -> None:
        """End of schedule(): no request is asking, and a victim vLLM chose not to evict is forgotten."""
        self.asking = None
        self._victim = None

    def pop(self, index: SupportsIndex = -1) -> Request:
        victim, self._victim = self._victim, None
        if victim is None or int(index) != -1:
            return super().pop(index)
        at = next(i for i, r in enumerate(self) if r is victim)
        return super().pop(at)
