"""What the row flags say on stderr: rows that multiply, a router replaced, a router misspelt."""

from __future__ import annotations

import json
from pathlib import Path

from cbcore.cli.main import main

WORKLOAD = "poisson:n=6,rate=50,lengths=fixed,input_len=16,output_len=4"


def simulate(*args: str) -> int:
    return main(["simulate", "--profile", "h200-llama-3-8b", "--no-progress", "--workload", WORKLOAD, *args])


def test_config_times_policy_rows_are_announced(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    b.write_text(json.dumps({"scheduler": {"budget": {"max_num_seqs": 2}}}))
    assert simulate("--config", str(a), "--config", str(b), "--policy", "fcfs", "--policy", "edf") == 0
    captured = capsys.readouterr()
    assert "2 --config x 2 --policy = 4 rows" in captured.err
    assert "a/fcfs" in captured.out and "b/edf" in captured.out
    assert simulate("--policy", "fcfs", "--policy", "edf") == 0  # policies alone do not multiply anything
    assert "rows" not in capsys.readouterr().err


def test_router_names_are_checked_with_a_suggestion_and_a_replaced_router_is_said(tmp_path: Path, capsys) -> None:
    assert simulate("--replicas", "2", "--router", "least-load") == 2
    err = capsys.readouterr().err
    assert "--router least-load: unknown router (did you mean 'least-loaded'?); known: least-loaded" in err
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"router": {"name": "round-robin"}}))
    assert simulate("--config", str(config), "--replicas", "2", "--router", "least-loaded") == 0
    assert "--router replaces the config's router 'round-robin'" in capsys.readouterr().err
    assert simulate("--replicas", "2", "--router", "least-loaded") == 0  # the default router: nothing to say
    assert "replaces" not in capsys.readouterr().err


def test_each_command_titles_its_own_figure(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    titles: list[str] = []
    original = Figure.suptitle
    monkeypatch.setattr(Figure, "suptitle", lambda self, t, **kw: titles.append(t) or original(self, t, **kw))
    assert simulate("--policy", "fcfs", "--plot", str(tmp_path / "one.png")) == 0
    assert simulate("--policy", "fcfs", "--sweep", "n=3,6", "--plot", str(tmp_path / "sweep.png")) == 0
    assert [t.split(":")[0] for t in titles] == ["cb simulate", "cb simulate"]
    assert "at n=3/6" in titles[1]
