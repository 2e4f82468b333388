"""Stop strings as one Aho-Corasick automaton: the cost per token follows the new text, not the list.

Searching each new piece of text for every stop string costs (strings x
text) per token on the event loop; with thousands of strings that stalls
every stream. The automaton reads each new character once (amortised O(1)),
and its state says two things at once: whether a stop string has just
ended, and the longest tail of the text that could still become one (what
must be held back). Automata are cached per stop list, as clients tend to
send the same few.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class StopAutomaton:
    goto: tuple[dict[str, int], ...]  # state -> character -> next state (trie edges)
    fail: tuple[int, ...]  # state -> the state of its longest proper suffix that is in the trie
    depth: tuple[int, ...]  # state -> length of the text it stands for
    ends: tuple[int, ...]  # state -> length of the longest stop string ending here (0: none)

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


@lru_cache(maxsize=256)
def automaton(stops: tuple[str, ...]) -> StopAutomaton:
    goto: list[dict[str, int]] = [{}]
    depth = [0]
    own = [0]
    for stop in stops:
        state = 0
        for ch in stop:
            nxt = goto[state].get(ch)
            if nxt is None:
                nxt = goto[state][ch] = len(goto)
                goto.append({})
                depth.append(depth[state] + 1)
                own.append(0)
            state = nxt
        own[state] = len(stop)
    fail = [0] * len(goto)
    ends = list(own)
    queue = deque(goto[0].values())
    while queue:
        state = queue.popleft()
        for ch, nxt in goto[state].items():
            f = fail[state]
            while f and ch not in goto[f]:
                f = fail[f]
            fail[nxt] = goto[f].get(ch, 0)
            ends[nxt] = max(ends[nxt], ends[fail[nxt]])
            queue.append(nxt)
    return StopAutomaton(tuple(goto), tuple(fail), tuple(depth), tuple(ends))


class StopMatcher:
    """One request's position in the automaton of its stop strings."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.automaton = automaton(stops)
        self.state = 0

    @property
    def held(self) -> int:
        """How many characters at the end of the text read so far could begin a stop string."""
        return self.automaton.depth[self.state]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Read ``text``; at the first stop string that ends in it: (index just past its end, its length).

        The first to *end* wins (the longest of those ending at the same
        character), which is what streaming one character at a time would
        see, so the answer does not depend on where token boundaries fall.
        """
        a, state = self.automaton, self.state
        for i, ch in enumerate(text):
            state = a.step(state, ch)
            if a.ends[state]:
                self.state = state
                return i + 1, a.ends[state]
        self.state = state
        return None
