"""The policy author's surface, counted by ``scripts/author_surface.py``: at most 20 names, listed in the docs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cbcore.scheduling import policy
from cbcore.scheduling.door import REMOVED, REMOVED_BY_KIND

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "author_surface.py"
BEGIN, END = "<!-- begin: scripts/author_surface.py --markdown -->\n", "<!-- end: scripts/author_surface.py -->"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def surface() -> ModuleType:
    spec = importlib.util.spec_from_file_location("author_surface", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_the_script_prints_at_most_twenty_names_and_passes() -> None:
    done = run()
    assert done.returncode == 0, done.stderr
    *rows, last = done.stdout.strip().splitlines()
    count = int(last.split()[0])
    assert count == len(rows) <= 20
    printed = {row.split()[0] for row in rows}
    assert set(policy.__all__) <= printed  # every public class of the policy module
    assert "kind" not in printed  # set by the base a plugin subclasses, never by the plugin
    gone = set(REMOVED).union(*REMOVED_BY_KIND.values()) - {"order"}  # `order` stays, on the queue
    assert not printed & gone, "a name that left the API is still counted"


def test_the_script_fails_above_its_limit(surface: ModuleType) -> None:
    count = len(surface.author_surface())
    done = run("--max", str(count - 1))
    assert done.returncode == 1
    assert f"has {count} names, more than {count - 1}" in done.stderr


def test_the_rule_counts_what_a_plugin_may_set_and_not_the_views(
    surface: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {n.name for n in surface.author_surface()}
    monkeypatch.setattr(policy.QueuePolicy, "demote", lambda self, seq: None, raising=False)
    monkeypatch.setattr(policy.BudgetPolicy, "_private_cache", {}, raising=False)
    after = {n.name for n in surface.author_surface()}
    assert after - before == {"demote"}  # a new public method counts; a private attribute does not
    view_fields = set(policy.SequenceView.__annotations__) | set(policy.SchedulerState.__dataclass_fields__)
    assert not (before - set(policy.__all__)) & (view_fields - {"num_tokens"})  # num_tokens: the prefill method


def test_docs_policies_list_the_names_the_script_prints(surface: ModuleType) -> None:
    doc = (ROOT / "docs" / "policies.md").read_text()
    embedded = doc[doc.index(BEGIN) + len(BEGIN) : doc.index(END)]
    assert embedded == surface.markdown(surface.author_surface()), (
        "regenerate the section with `python scripts/author_surface.py --markdown`"
    )


def test_docs_policies_name_every_removed_name_with_its_replacement() -> None:
    doc = (ROOT / "docs" / "policies.md").read_text()
    table = doc[doc.index("## Names that left the API") :].split("\n## ")[0]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    assert rows == set(REMOVED).union(*REMOVED_BY_KIND.values())
