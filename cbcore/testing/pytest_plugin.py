"""pytest plugin (entry point ``pytest11``): equivalence and tiny-checkpoint fixtures.

A plugin author's whole equivalence test::

    def test_my_policy_keeps_outputs(cb_equivalence):
        cb_equivalence({"scheduler": {"queue": {"name": "my-policy"}}})
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


@pytest.fixture(scope="session")
def cb_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint directory with a byte-level tokenizer, for ``--model``."""
    from cbcore.testing.tiny_tokenizer import save_tiny_model_dir

    return save_tiny_model_dir(tmp_path_factory.mktemp("cb-tiny-model"), "llama")
