"""A measured profile whose held-out fit error is too large is not written, nor used without --force."""

from __future__ import annotations

from pathlib import Path

import pytest

from cbcore.cli.main import CLIError, main
from cbcore.cli.profile import write
from cbcore.sim.fitted import fit_cost
from cbcore.sim.profile import MAX_HOLDOUT_ERROR, Identity, Profile, load_profile
from cbcore.sim.shape import StepShape

WORKLOAD = "poisson:n=4,rate=inf,lengths=fixed,input_len=8,output_len=3"


def measured(holdout: float) -> Profile:
    """A measured profile of a clean synthetic cost whose recorded fit error is ``holdout``."""
    shapes = [
        StepShape(rows, 0, rows, context * rows, context * rows, tuple(range(rows)))
        for rows in (1, 2, 4, 8)
        for context in (16, 256, 1024)
    ]
    times = [0.01 + 0.002 * s.num_tokens + 1e-6 * s.kv_tokens for s in shapes]
    cost = fit_cost(shapes, times, [1, 2, 4, 8])
    cost = cost.model_copy(update={"fit": cost.fit.model_copy(update={"holdout_mean_abs": holdout})})
    identity = Identity(hardware="test cpu", model="test", dtype="float32", backend="sdpa", threads=1,
                        source="measured")  # fmt: skip
    return Profile(identity=identity, model=load_profile("h200-llama-3-8b").model, cost=cost)


def test_cb_simulate_refuses_a_busy_machines_profile_unless_forced(tmp_path: Path, capsys) -> None:
    busy = tmp_path / "busy.json"
    measured(1.47).save(busy)
    assert main(["simulate", "--profile", str(busy), "--workload", WORKLOAD, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "147.0 %" in err and "above the 25 %" in err
    assert "machine was probably busy" in err and "run `cb profile` again" in err and "--force" in err
    assert main(["simulate", "--profile", str(busy), "--workload", WORKLOAD, "--no-progress", "--force"]) == 0
    captured = capsys.readouterr()
    assert "used anyway (--force)" in captured.err and "out tok/s" in captured.out


def test_a_good_fit_and_a_roofline_pass_the_gate(tmp_path: Path) -> None:
    quiet = tmp_path / "quiet.json"
    measured(MAX_HOLDOUT_ERROR / 2).save(quiet)
    assert main(["simulate", "--profile", str(quiet), "--workload", WORKLOAD, "--no-progress"]) == 0
    assert load_profile("h200-llama-3-8b").unreliable("h200", "retry") is None


def test_cb_profile_does_not_write_a_poor_fit_without_force(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    with pytest.raises(CLIError, match=r"held-out step-time error is 60\.0 %.*probably busy.*nothing was written"):
        write(measured(0.6), str(out), "nothing was written; rerun", force=False)
    assert not out.exists()
    write(measured(0.6), str(out), "nothing was written; rerun", force=True)
    assert load_profile(out).fit_error() == pytest.approx(0.6)
