"""Which instruction set a C kernel is built for: timed once per machine, kept, and forced only on request.

The widest set the CPU runs is not always the fastest, so a kernel with a
trial is built for each and the trial timed, alternated; a narrower one is
chosen only when it is :data:`native.MARGIN` faster. The timing here runs on
a fake clock that the fake builds advance, so what is chosen follows from the
planted costs alone.
"""

from __future__ import annotations

import json
import logging
import types

import pytest

from cbcore.kernels import native, paged_decode

COSTS = {"avx512": 1.0, "avx2": 1.0, "plain": 3.0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A kernel whose builds are fake functions costing COSTS[isa] on a fake clock, on a 3-ISA CPU."""
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    monkeypatch.setattr(native, "supported_isas", lambda: ["avx512", "avx2", "plain"])
    monkeypatch.setattr(native, "_compiler", lambda: "cc")
    clock = FakeClock()
    monkeypatch.setattr(native, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    built: list[str] = []

    def library(self, compiler, isa):
        built.append(isa)

        def fn(isa=isa):
            clock.now += COSTS[isa]

        return fn, f"fake {isa}"

    monkeypatch.setattr(native.NativeKernel, "_library", library)

    def make(trial=True):
        kernel = native.NativeKernel(paged_decode.SOURCE, "cb_fake", [], trial=None)
        if trial:
            kernel.trial = lambda: (lambda: kernel.fn())
        return kernel

    make.built = built
    make.cache = tmp_path
    return make


@pytest.mark.parametrize(
    ("avx2", "chosen"),
    [(0.80, "avx2"), (0.99, "avx512"), (1.0, "avx512"), (1.5, "avx512")],
    ids=["narrower-20%-faster", "narrower-1%-faster", "equal", "narrower-slower"],
)
def test_a_narrower_instruction_set_is_chosen_only_when_clearly_faster(fake, monkeypatch, avx2, chosen):
    monkeypatch.setitem(COSTS, "avx2", avx2)
    assert fake().load()[1] == f"fake {chosen}"


def test_the_choice_is_kept_and_the_next_process_only_reads_it(fake, monkeypatch, caplog):
    monkeypatch.setitem(COSTS, "avx2", 0.5)
    with caplog.at_level(logging.INFO, logger="cbcore.kernels.native"):
        assert fake().load()[1] == "fake avx2"
    assert "kernel instruction set chosen by timing" in caplog.text and "chosen=avx2" in caplog.text
    (entry,) = json.loads((fake.cache / "kernels" / native.CHOICES_FILE).read_text()).values()
    assert entry["chosen"] == "avx2" and set(entry["least_us"]) == {"avx512", "avx2", "plain"}

    fake.built.clear()
    again = fake(trial=False)
    again.trial = lambda: pytest.fail("a kept choice is timed again")
    assert again.load()[1] == "fake avx2" and fake.built == ["avx2"]


def test_a_forced_instruction_set_is_built_alone_without_a_trial(fake, monkeypatch):
    monkeypatch.setitem(COSTS, "avx2", 0.5)
    monkeypatch.setenv(native.ISA_ENV, "plain")
    monkeypatch.setattr(native, "forced_isa", lambda: "plain")
    kernel = fake(trial=False)
    kernel.trial = lambda: pytest.fail("a forced instruction set is not timed")
    assert kernel.load()[1] == "fake plain" and fake.built == ["plain"]


def test_a_kernel_without_a_trial_is_built_for_the_widest(fake, monkeypatch):
    monkeypatch.setitem(COSTS, "avx2", 0.1)
    assert fake(trial=False).load()[1] == "fake avx512" and fake.built == ["avx512"]


def test_this_machine_times_its_instruction_sets_once_for_the_paged_decode_kernel(monkeypatch, tmp_path, caplog):
    isas = native.supported_isas()
    if len(isas) < 2:
        pytest.skip("this CPU runs one instruction set: nothing to choose")
    monkeypatch.setenv("CBCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    paged_decode.KERNEL.forget()
    try:
        with caplog.at_level(logging.INFO, logger="cbcore.kernels.native"):
            fn, origin = paged_decode.KERNEL.load()
        assert fn is not None, origin
        (entry,) = json.loads((tmp_path / "kernels" / native.CHOICES_FILE).read_text()).values()
        assert set(entry["least_us"]) == set(isas) and entry["chosen"] in isas
        assert f"paged_decode-{entry['chosen']}-" in origin  # the chosen build is the one loaded
        assert f"chosen={entry['chosen']}" in caplog.text
    finally:
        paged_decode.KERNEL.forget()


def test_a_cap_on_the_libraries_instruction_sets_keys_its_own_choices(monkeypatch):
    """oneDNN capped to AVX2 runs another speed than oneDNN free: a choice timed free must not be reused."""
    for name in native.LIBRARY_ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    free = native.machine_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert native.machine_key() == free + ":ONEDNN_MAX_CPU_ISA=AVX2"
