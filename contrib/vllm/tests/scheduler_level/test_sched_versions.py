"""The version gate, and which vLLM this venv holds (the log of `make test-vllm-sched` names each)."""

from __future__ import annotations

import pytest
from cbcore_vllm._cbcore import ConfigError
from cbcore_vllm.config import TESTED_VLLM
from cbcore_vllm.shim import SECTIONS, V0_32, V0_33, V0_34, for_version
from sched_level import PLUGIN, VERSION, drive, expected_version


def test_this_venv_holds_the_version_it_is_tested_as() -> None:
    assert VERSION in TESTED_VLLM
    if expected_version() is not None:
        assert expected_version() == VERSION


def test_each_tested_version_has_its_own_section() -> None:
    assert [type(for_version(v, False)) for v in TESTED_VLLM] == [V0_32, V0_33, V0_34]
    assert set(SECTIONS) == set(TESTED_VLLM)


def test_untested_version_is_refused_unless_allowed() -> None:
    with pytest.raises(ConfigError, match=r"tested on vLLM 0.32.0, 0.33.0, 0.34.0; this is 0.35.0.*allow_untested_vllm"):
        for_version("0.35.0", allow_untested=False)
    assert type(for_version("0.35.1rc1", allow_untested=True)) is V0_34  # the newest tested one not newer
    assert type(for_version("0.33.2", allow_untested=True)) is V0_33
    assert type(for_version("0.31.0", allow_untested=True)) is V0_32  # older than all: the oldest


def test_scheduler_refuses_an_untested_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    config = {"scheduler": {"queue": {"name": "fcfs"}}}
    with pytest.raises(ConfigError, match=r"this is 0\.35\.0"):
        drive(config, [], max_num_seqs=1, max_num_batched_tokens=64)
    driver, _ = drive(config | {"allow_untested_vllm": True}, [], max_num_seqs=1, max_num_batched_tokens=64)
    assert type(driver.scheduler._vllm) is V0_34


def test_the_adapter_extends_vllms_async_scheduler() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    driver, _ = drive({"plugins": [PLUGIN]}, [], max_num_seqs=1, max_num_batched_tokens=64)
    assert isinstance(driver.scheduler, AsyncScheduler)
