"""Count the names a policy author must learn, by one rule, from the code itself.

The rule: the public classes of the policy module (``cbcore.scheduling.policy.__all__``),
and the methods and class attributes a plugin overrides or sets, read from the
four policy base classes (``QueuePolicy``, ``BudgetPolicy``, ``PrefillPolicy``,
``PreemptionPolicy``) and their common base. A member counts when it is public
(no leading underscore) and a plugin may set it: a name that every one of the
four bases sets itself (``kind``) is the base's, not the author's. The fields
of the read-only views a policy is handed (``SequenceView``, ``SchedulerState``,
``StepResult``, ``state.kv``) are read, not learned as API, and do not count.

usage: python scripts/author_surface.py [--max N] [--markdown]
Prints the names and their count; exits 1 when there are more than N (20).
``--markdown`` prints the list as docs/policies.md embeds it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from dataclasses import dataclass

from cbcore.scheduling import policy

KINDS = (policy.QueuePolicy, policy.BudgetPolicy, policy.PrefillPolicy, policy.PreemptionPolicy)
LIMIT = 20


@dataclass(frozen=True)
class Name:
    name: str
    where: str  # the class that defines it
    what: str  # "class", "method" or "class attribute"


def common_base(classes: tuple[type, ...]) -> type:
    """The nearest class every one of ``classes`` derives from (besides ``object``)."""
    for candidate in classes[0].__mro__[1:]:
        if candidate is not object and all(issubclass(c, candidate) for c in classes):
            return candidate
    raise LookupError(f"{[c.__name__ for c in classes]} share no base but object")


def own_members(cls: type) -> dict[str, str]:
    """Public names ``cls`` itself defines, with what each is: its methods and class attributes
    (annotated ones included: ``name: ClassVar[str]`` is one a plugin must set)."""
    found = {n: "class attribute" for n in inspect.get_annotations(cls) if not n.startswith("_")}
    for n, value in vars(cls).items():
        if not n.startswith("_"):
            found[n] = "method" if callable(value) and not inspect.isclass(value) else "class attribute"
    return found


def author_surface() -> list[Name]:
    """Every name of the policy API by the rule above, in the order the module defines it."""
    names = [Name(n, policy.__name__, "class") for n in policy.__all__]
    base = common_base(KINDS)
    per_kind = {cls: own_members(cls) for cls in KINDS}
    the_bases_own = set.intersection(*(set(m) for m in per_kind.values()))  # ``kind``: each base sets it
    seen: set[str] = set()
    for cls, members in [(base, own_members(base)), *per_kind.items()]:
        for n, what in members.items():
            if n not in the_bases_own and n not in seen:
                seen.add(n)
                names.append(Name(n, cls.__name__, what))
    return names


def markdown(names: list[Name]) -> str:
    classes = ", ".join(f"`{n.name}`" for n in names if n.what == "class")
    lines = [f"The classes ({sum(n.what == 'class' for n in names)}): {classes}.", ""]
    by_class: dict[str, list[str]] = {}
    for n in names:
        if n.what != "class":
            by_class.setdefault(n.where, []).append(f"`{n.name}`")
    common = common_base(KINDS).__name__
    for where, members in by_class.items():
        label = "every policy (their common base)" if where == common else f"`{where}`"
        lines.append(f"* {label}: {', '.join(members)}")
    lines += ["", f"**{len(names)} names** (at most {LIMIT})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=LIMIT, help="fail above this many names (default %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print the list as docs/policies.md embeds it")
    args = parser.parse_args(argv)
    names = author_surface()
    if args.markdown:
        print(markdown(names), end="")
    else:
        for n in names:
            print(f"{n.name:<18} {n.what:<16} {n.where}")
        print(f"{len(names)} names (at most {args.max})")
    if len(names) > args.max:
        print(f"the policy API has {len(names)} names, more than {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
