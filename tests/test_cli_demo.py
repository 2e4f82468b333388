"""`cb demo` on a tiny model: slot admissions, the mask pictures, identical tokens, the plot.

The caps are scaled down (same shape: one short, one long, refills in
between) to keep the test quick; the step numbers below follow from them.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from cbcore.cli.main import main
from cbcore.demo import run as demo

SMALL = [
    ("The capital of France is", 3),
    ("Today's weather is so", 10),
    ("In machine learning, a transformer is", 40),
    ("Once upon a time in a land far away,", 8),
    ("Quantum computing differs from classical computing because", 25),
    ("The history of the Roman Empire began", 9),
]


@pytest.fixture(scope="module")
def demo_output(cb_tiny_model_dir, tmp_path_factory):
    plot = tmp_path_factory.mktemp("demo") / "timeline.png"
    argv = ["demo", "--model", str(cb_tiny_model_dir), "--plot", str(plot), "--set", "kv_cache.num_blocks=64"]
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(buf):
        mp.setattr(demo, "DEMO_REQUESTS", SMALL)
        code = main(argv)
    return code, buf.getvalue(), plot


def section(out: str, title: str) -> str:
    """The lines after the header line that starts with ``title``, up to the next header."""
    return out.split(title, 1)[1].split("\n", 1)[1].split("\n===", 1)[0]


def test_demo_contrasts_static_waves_with_continuous_refills(demo_output):
    code, out, _ = demo_output
    assert code == 0, out
    static = section(out, "=== static batching")
    continuous = section(out, "=== continuous batching")
    # Static: D waits for the whole first wave (C, 40 tokens); its slot stays empty meanwhile.
    assert "[step   3] slot 0 done A" in static
    assert "[step   4] slot 0 stays empty: D, E, F wait for the wave to end" in static
    assert "[step  41] slot 0 <- D" in static
    # Continuous: A's slot is refilled by D at the very next step.
    assert "[step   3] slot 0 done A" in continuous
    assert "[step   4] slot 0 <- D" in continuous
    assert "stays empty" not in continuous
    assert "identical tokens: yes, all 6 requests" in out
    summary = section(out, "=== summary")
    static_idle = int(re.search(r"static:.* (\d+) left empty while requests waited", summary).group(1))
    assert static_idle > 0
    assert re.search(r"continuous:.* 0 left empty while requests waited", summary)


def test_demo_draws_the_block_diagonal_masks(demo_output):
    _, out, _ = demo_output
    prefill = out.split("STEP 1: the prompts packed together (all prefill)", 1)[1].split("\n\n", 2)[1]
    rows = [line.split() for line in prefill.splitlines()[2:]]
    # Every query row of the all-prefill step: causal within its own block, nothing elsewhere.
    for label, pos, *groups in rows:
        own = "ABC".index(label)
        p = int(pos[1:])
        for g, cells in enumerate(groups):
            expected = "#" * (p + 1) + "." * (len(cells) - p - 1) if g == own else "." * len(cells)
            assert cells == expected, (label, pos, groups)
    mixed = out.split("STEP 4: prefill and decode fused in one forward", 1)[1].split("\n\n", 2)
    assert "D = slot 0  prefill(" in mixed[0] and "B = slot 1  decode(1)" in mixed[0]
    mask = mixed[1].splitlines()
    keys = mask[1].split()
    assert keys[0] == "keys" and "|" in keys[1]  # B's keys: cached | new
    b_row = next(line.split() for line in mask[2:] if line.split()[0] == "B")
    assert set(b_row[2].replace("|", "")) == {"#"}  # the decode token sees all of its own keys
    assert set("".join(b_row[3:]).replace("|", "")) == {"."}  # and nobody else's


def test_demo_plot_is_a_png(demo_output):
    _, out, plot = demo_output
    assert f"slot timeline of both runs: {plot}" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unwritable_plot_path_fails_before_running(capsys):
    code = main(["demo", "--model", "/does/not/matter", "--plot", "/no/such/dir/t.png"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == "cb: error: cannot write --plot /no/such/dir/t.png: directory /no/such/dir does not exist\n"
