"""vLLM's running list, through which cbcore's preemption policy picks the victim.

vLLM chooses a victim inline in ``Scheduler.schedule()`` when a running
request cannot get KV blocks. Its running loop walks the list in order, so
the request asking for room and every request after it are the ones not yet
scheduled this step -- exactly cbcore's victim candidates. When such a
request's allocation fails (the shim's ``allocate_slots`` wrapper calls
:meth:`VictimList.asks`), the list answers vLLM's next victim read with the
preemption policy's choice among those candidates. vLLM reads its victim one
of two ways, by path; ``shim.py`` says which version takes which:

* fcfs (:class:`FcfsVictims`): ``running[-1]``, then ``running.pop()``;
* priority (:class:`PriorityVictims`): ``max(running, key=...)`` -- one
  iteration -- then ``running.index(victim)`` and ``del running[i]``.

Every other use is a plain list; only the read a path makes is overridden,
so that vLLM's other reads of ``running`` (one index read per running
request per step) cost what a list's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, SupportsIndex

from vllm.v1.request import Request


class VictimList(list[Request]):
    """``running``, whose victim read is answered by ``choose(candidates)`` after a request's allocation failed."""

    def __init__(self, items: Iterable[Request], choose: Callable[[list[Request]], Request]) -> None:
        super().__init__(items)
        self._choose = choose
        self._asking: Request | None = None  # a running request allocate_slots() could not serve
        self._victim: Request | None = None  # the answer, until vLLM takes it

    def asks(self, request: Request) -> None:
        """``request``'s allocation failed: vLLM's next victim read asks for a victim for it."""
        self._asking, self._victim = request, None

    def _answer(self) -> Request:
        asker, self._asking = self._asking, None
        at = next(i for i, r in enumerate(list.__iter__(self)) if r is asker)
        self._victim = self._choose(list.__getitem__(self, slice(at, None)))
        return self._victim

    def settle(self) -> None:
        """End of schedule(): nobody is asking, and a victim vLLM chose not to evict is forgotten."""
        self._asking = None
        self._victim = None


class FcfsVictims(VictimList):
    """vLLM's fcfs path: ``running[-1]`` is the victim, ``running.pop()`` removes it."""

    def __getitem__(self, index: Any) -> Any:
        if index == -1 and self._asking is not None:
            return self._answer()
        return super().__getitem__(index)

    def pop(self, index: SupportsIndex = -1) -> Request:
        victim, self._victim = self._victim, None
        if victim is None or int(index) != -1:
            return super().pop(index)
        return super().pop(self.index(victim))


class PriorityVictims(VictimList):
    """vLLM's priority path: ``max(running, key=...)`` is the victim; it then finds and deletes it by index."""

    def __iter__(self) -> Iterator[Request]:
        if self._asking is not None:
            return iter((self._answer(),))
        return super().__iter__()
