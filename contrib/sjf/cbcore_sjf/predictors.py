"""Output-length predictors for shortest-predicted-job-first.

A predictor is any callable ``(seq) -> float`` returning the number of tokens
a request is expected to generate. The ``predictor`` parameter of the ``sjf``
policy names one registered here, or any function as ``package.module:function``
(or ``path/to/file.py:function``), so a learned predictor plugs in without
touching this package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cbcore import SequenceView
from cbcore.plugins import PluginError, load_class


class Predictor(Protocol):
    def __call__(self, seq: SequenceView) -> float: ...


def prompt_length(seq: SequenceView) -> float:
    """Long prompts tend to get long answers: predict as many tokens as the prompt has, within the cap."""
    return float(min(seq.num_prompt_tokens, seq.params.max_new_tokens))


def max_new_tokens(seq: SequenceView) -> float:
    """The request's own cap: an upper bound every client states up front."""
    return float(seq.params.max_new_tokens)


PREDICTORS: dict[str, Predictor] = {
    "prompt-length": prompt_length,
    "max-new-tokens": max_new_tokens,
}


def register_predictor(name: str, predictor: Predictor) -> None:
    """Make ``predictor`` selectable by ``name``; a name is registered once."""
    if name in PREDICTORS and PREDICTORS[name] is not predictor:
        raise PluginError(f"predictor {name!r} is already registered ({PREDICTORS[name]!r})")
    PREDICTORS[name] = predictor


def resolve_predictor(ref: str) -> Callable[[SequenceView], float]:
    """A registered name or ``module:function``; anything else is an error listing the names."""
    if ref in PREDICTORS:
        return PREDICTORS[ref]
    if ":" not in ref:
        raise PluginError(
            f"unknown predictor {ref!r}; known: {', '.join(sorted(PREDICTORS))} (or module:function)"
        )
    found = load_class(ref)
    if not callable(found):
        raise PluginError(f"predictor {ref!r} is not callable")
    return found
