"""pytest plugin (entry point ``pytest11``): the ``cb_equivalence`` fixture.

A plugin author's whole equivalence test::

    def test_my_policy_keeps_outputs(cb_equivalence):
        cb_equivalence({"scheduler": {"queue": {"name": "my-policy"}}})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cbcore.testing.compare import EquivalenceReport, assert_equivalent


@pytest.fixture
def cb_equivalence() -> Callable[..., EquivalenceReport]:
    """Call with an engine config (dict or EngineConfig) and optional ``run_equivalence`` arguments.

    Fails the test with a per-request table on a real divergence; returns the
    report (its ``engine`` attribute is the engine that ran) for further assertions.
    """
    from cbcore.testing.check import run_equivalence

    def check(config: Any = None, **kwargs: Any) -> EquivalenceReport:
        report = run_equivalence(config, **kwargs)
        assert_equivalent(report)
        return report

    return check
