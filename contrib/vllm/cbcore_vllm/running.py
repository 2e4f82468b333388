"""vLLM's running list, through which cbcore's preemption policy picks the victim.

vLLM chooses a victim inline in ``Scheduler.schedule()`` when a running
request cannot get KV blocks. Its running loop walks the list in order, so
the request asking for room and every request after it are the ones not yet
scheduled this step -- exactly cbcore's victim candidates. While such a
request asks (noted by the shim's ``allocate_slots`` wrapper), this list
answers vLLM's next victim read with the preemption policy's choice among
those candidates. vLLM reads its victim one of two ways, by version and path
(``shim.py`` says which is taken where):

* fcfs: ``running[-1]``, then ``running.pop()``;
* priority: ``max(running, key=...)`` -- one iteration -- then
  ``running.index(victim)`` and ``del running[i]``.

Every other use is a plain list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, SupportsIndex

from vllm.v1.request import Request


class VictimList(list[Request]):
    """``running``, whose victim read is answered by ``choose(candidates)`` while a request asks for room."""

    def __init__(self, items: Iterable[Request], choose: Callable[[list[Request]], Request]) -> None:
        super().__init__(items)
        self._choose = choose
        self._asking: Request | None = None  # a running request allocate_slots() could not serve yet
        self._victim: Request | None = None  # the answer, until vLLM pops it

    def asks(self, request: Request) -> None:
        """``request`` (running) calls allocate_slots(): if that fails, vLLM's next read asks for a victim."""
        self._asking, self._victim = request, None

    def answered(self) -> None:
        """allocate_slots() succeeded: no victim is wanted."""
        self._asking = None

    def _answer(self) -> Request:
        asker, self._asking = self._asking, None
        it = list.__iter__(self)
        at = next(i for i, r in enumerate(it) if r is asker)
        self._victim = self._choose(list.__getitem__(self, slice(at, None)))
        return self._victim

    def __getitem__(self, index: Any) -> Any:
        if self._asking is not None and index == -1:
            return self._answer()
        return super().__getitem__(index)

    def __iter__(self) -> Iterator[Request]:
        if self._asking is not None:
            return iter((self._answer(),))
        return super().__iter__()

    def pop(self, index: SupportsIndex = -1) -> Request:
        victim, self._victim = self._victim, None
        if victim is None or int(index) != -1:
            return super().pop(index)
        return super().pop(self.index(victim))

    def settle(self) -> None:
        """End of schedule(): nobody is asking, and a victim vLLM chose not to evict is forgotten."""
        self._asking = None
        self._victim = None
