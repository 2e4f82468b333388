"""What a client may be told when the engine fails: the plugin and the method, never more.

The server's log gets the whole exception. A client gets a sentence built from
what the engine itself named (``PolicyError.public``, a plugin's name without
the place it was loaded from, a rule of the engine): an exception's own text
may hold another client's request id (a plugin that prints its queue) or a
path on the server (a plugin file's), so it is never sent.
"""

from __future__ import annotations

from collections.abc import Mapping

from cbcore.scheduling.door import PolicyError
from cbcore.scheduling.scheduler import SchedulerError


def public_name(description: str) -> str:
    """``queue policy 'x'`` of ``queue policy 'x' (path /srv/x.py)``: a plugin without where it was loaded from."""
    return description.split(" (")[0]


def public_reason(exc: BaseException, names: Mapping[int, str]) -> str:
    """Why the engine stopped, for a client: ``names`` are the scheduler's plugins (their descriptions)."""
    if isinstance(exc, PolicyError):
        return exc.public
    if isinstance(exc, SchedulerError):
        if isinstance(exc.__cause__, PolicyError):  # the same failure, request after request, in one step
            return f"{exc.__cause__.public}, for one request after another"
        culprit = exc.plugin
        for name in names.values():  # a rule several policies share names them all
            culprit = culprit.replace(name, public_name(name))
        if culprit:
            return f"{culprit} broke the rule '{exc.rule}'"
    return f"{type(exc).__name__} in the engine"


def scheduler_names(scheduler: object) -> Mapping[int, str]:
    """The scheduler's plugins by ``id``: the four policies behind its door, or the one whole scheduler."""
    door = getattr(scheduler, "door", None)
    return getattr(door if door is not None else scheduler, "names", {})
