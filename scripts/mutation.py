"""Mutation testing of the code where a silent bug costs most: ``make mutation``.

Reads ``mutation.toml`` (the targets: a module, the functions of it that are mutated, the fast
tests that concern them; the operators left out; the equivalent mutants, each with its reason),
and for each target drives cosmic-ray: ``init`` lists every mutant of the module, this script
marks as skipped those outside the configured functions, those inside a log call or an f-string
(a message's text, not behaviour), those of an excluded operator and the listed equivalents,
then ``exec`` runs the target's tests once per remaining mutant. Prints, per target and in
all, killed/total and the survivors with their diffs, then the wall time.

cosmic-ray writes each mutant into the source tree and puts the file back after its run; this
script also keeps a copy of each target module and restores it if a run was interrupted
midway. The tests run through ``scripts/mutation_runner.py`` (a warm pytest that imports
torch and the rest once, then forks a fresh child per mutant), so a mutant costs its tests'
time, not ten seconds of imports.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import random
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "scripts" / "mutation_runner.py"
sys.path.insert(0, str(RUNNER.parent))
from mutation_runner import UNREACHABLE_MARK  # noqa: E402

PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider"]
COSMIC_RAY = str(Path(sys.executable).parent / "cosmic-ray")
LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"}
LOG_NAMES = {"log", "logger", "_log", "LOG", "_logger"}
SAMPLE_MIN = 15
NOT_SAMPLED = "not in this sample"
OWN_PACKAGES = "cbcore,cbcore_vllm,policies,backends,tests,support,conftest"


@dataclass
class Target:
    name: str
    module: str
    functions: list[str]
    tests: list[str]
    equivalent: list[dict] = field(default_factory=list)


def load(path: Path) -> tuple[dict, list[Target]]:
    config = tomllib.loads(path.read_text())
    targets = []
    for t in config.get("target", []):
        missing = {"name", "module", "functions", "tests"} - t.keys()
        if missing:
            sys.exit(f"{path}: a [[target]] lacks {sorted(missing)}: {t}")
        targets.append(Target(t["name"], t["module"], t["functions"], t["tests"], t.get("equivalent", [])))
    return config.get("settings", {}), targets


# -- which mutants count --------------------------------------------------------------------


def _spans(tree: ast.AST) -> tuple[list[tuple[str, ast.AST]], list[ast.AST]]:
    """The functions and classes (by qualified name) and the nodes never run as behaviour.

    Those are a message's text (a log call, an f-string) and annotations: the targets import
    ``annotations`` from ``__future__``, so an annotation is never evaluated, and a pydantic
    model's that is mutated into nonsense fails at import, which any test catches.
    """
    defs: list[tuple[str, ast.AST]] = []
    messages: list[ast.AST] = []

    def annotations(node: ast.AST) -> list[ast.AST]:
        found = [getattr(node, "returns", None), getattr(node, "annotation", None)]
        return [a for a in found if a is not None]

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            messages.extend(annotations(child))
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                defs.append((name, child))
                visit(child, name + ".")
                continue
            if isinstance(child, ast.JoinedStr) or (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in LOG_METHODS
                and isinstance(child.func.value, ast.Name)
                and child.func.value.id in LOG_NAMES
            ):
                messages.append(child)
            visit(child, prefix)

    visit(tree, "")
    return defs, messages


def _inside(node: ast.AST, pos: tuple[int, int]) -> bool:
    start = (node.lineno, node.col_offset)
    end = (node.end_lineno, node.end_col_offset)
    return start <= pos < end


class Classifier:
    """Says why a mutant is left out, or None when it is one to run."""

    def __init__(self, target: Target, exclude_operators: list[str]) -> None:
        import re

        self.source = (ROOT / target.module).read_text()
        self.lines = self.source.splitlines()
        self.defs, self.messages = _spans(ast.parse(self.source))
        known = {name for name, _ in self.defs}
        if unknown := [f for f in target.functions if f not in known]:
            sys.exit(f"mutation.toml: {target.module} has no function or class {unknown}")
        self.functions = target.functions
        self.exclude = re.compile("|".join(f"(?:{e})" for e in exclude_operators)) if exclude_operators else None
        self.equivalent = target.equivalent
        for eq in self.equivalent:
            if not {"line", "to", "reason"} <= eq.keys():
                sys.exit(f"mutation.toml: an equivalent mutant of {target.module} needs line, to, reason: {eq}")
            if not any(eq["line"] == line.strip() for line in self.lines):
                sys.exit(f"mutation.toml: {target.module} has no line {eq['line']!r} (listed as equivalent)")
        self.used_equivalents: set[int] = set()

    def function_at(self, pos: tuple[int, int]) -> str | None:
        inner = None
        for name, node in self.defs:
            if node.lineno <= pos[0] <= node.end_lineno:
                inner = name if inner is None or len(name) > len(inner) else inner
        return inner

    def mutated_line(self, operator: str, occurrence: int, line: int) -> str:
        """The line as the mutant has it (cosmic-ray's own mutation of the source)."""
        from cosmic_ray.mutating import mutate_code
        from cosmic_ray.plugins import get_operator

        mutated = mutate_code(self.source, get_operator(operator)(), occurrence)
        return mutated.splitlines()[line - 1].strip() if mutated is not None else ""

    def why_skipped(self, operator: str, occurrence: int, pos: tuple[int, int]) -> str | None:
        function = self.function_at(pos)
        if function is None or not any(function == f or function.startswith(f + ".") for f in self.functions):
            return "outside the configured functions"
        if any(_inside(node, pos) for node in self.messages):
            return "in a message's text (a log call or an f-string) or an annotation"
        if self.exclude is not None and self.exclude.fullmatch(operator):
            return "operator excluded"
        line = self.lines[pos[0] - 1].strip()
        for i, eq in enumerate(self.equivalent):
            before = self.lines[pos[0] - 2].strip() if pos[0] > 1 else ""
            if "previous" in eq and before != eq["previous"]:
                continue
            if line == eq["line"] and self.mutated_line(operator, occurrence, pos[0]) == eq["to"]:
                self.used_equivalents.add(i)
                return f"equivalent: {eq['reason']}"
        return None


# -- running --------------------------------------------------------------------------------


class Runner:
    """The warm pytest server (scripts/mutation_runner.py serve) for the whole session."""

    def __init__(self, workdir: Path) -> None:
        self.socket = str(workdir / "runner.sock")
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.log = open(workdir / "runner.log", "w")  # noqa: SIM115 -- open while the server lives
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "serve", "--socket", self.socket, "--root", str(ROOT), "--own", OWN_PACKAGES],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        )
        if (line := self.proc.stdout.readline().strip()) != "ready":
            sys.exit(f"the mutation runner did not start (said {line!r}; see {self.log.name})")

    def command(self, tests: list[str], learn: bool = False) -> list[str]:
        return [sys.executable, str(RUNNER), "run", "--socket", self.socket, *(["--learn"] if learn else []),
                "--", *PYTEST_ARGS, *tests]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def cosmic_ray(*args: str) -> None:
    done = subprocess.run([COSMIC_RAY, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cosmic-ray {args[0]} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


def write_config(target: Target, workdir: Path, timeout: float, test_command: list[str]) -> tuple[Path, Path]:
    config = workdir / f"{target.name}.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {target.module!r}\n"
        f"timeout = {timeout:.0f}\n"
        "excluded-modules = []\n"
        f"test-command = {shlex.join(test_command)!r}\n"
        "[cosmic-ray.distributor]\nname = 'local'\n"
    )
    return config, workdir / f"{target.name}.sqlite"


def prepare(
    target: Target, settings: dict, workdir: Path, timeout: float, test_command: list[str], sample: float | None = None
) -> tuple[Path, Path, int]:
    """cosmic-ray's session for one target, with the mutants that are not to run marked skipped.

    ``sample``: run only this share of the target's mutants (at least SAMPLE_MIN of them), drawn
    with a seed fixed per target, so that a busy machine still gets an estimate of the score.
    """
    config, db_path = write_config(target, workdir, timeout, test_command)
    cosmic_ray("init", str(config), str(db_path), "--force")
    classifier = Classifier(target, settings.get("exclude-operators", []))
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            (mutation,) = item.mutations
            if reason := classifier.why_skipped(mutation.operator_name, mutation.occurrence, tuple(mutation.start_pos)):
                db.set_result(item.job_id, WorkResult(output=reason, worker_outcome=WorkerOutcome.SKIPPED))
        pending = [item.job_id for item in sorted(db.pending_work_items, key=_position)]
        if sample is not None:
            keep = set(random.Random(f"cbcore {target.name}").sample(pending, min(len(pending), max(
                SAMPLE_MIN, math.ceil(sample * len(pending))))))
            for job_id in pending:
                if job_id not in keep:
                    db.set_result(job_id, WorkResult(output=NOT_SAMPLED, worker_outcome=WorkerOutcome.SKIPPED))
            pending = sorted(keep)
        to_run = len(pending)
    if unused := [eq for i, eq in enumerate(target.equivalent) if i not in classifier.used_equivalents]:
        sys.exit(f"mutation.toml: {target.name}: listed equivalents that match no mutant: {unused}")
    return config, db_path, to_run


def _position(item: object) -> tuple:
    (mutation,) = item.mutations
    return (tuple(mutation.start_pos), mutation.operator_name, mutation.occurrence)


def reopen(target: Target, workdir: Path, timeout: float, test_command: list[str]) -> tuple[Path, Path, int]:
    """The last session of a target, its survivors marked to run again (with the tests mutation.toml lists now)."""
    if not (workdir / f"{target.name}.sqlite").exists():
        sys.exit(f"{target.name}: no earlier session in {workdir} to rerun the survivors of")
    config, db_path = write_config(target, workdir, timeout, test_command)
    classifier = Classifier(target, [])  # an equivalent listed since: left out, not run again
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        survived = [item for item, result in db.completed_work_items if result.test_outcome == TestOutcome.SURVIVED]
        again = []
        for item in survived:
            (mutation,) = item.mutations
            reason = classifier.why_skipped(mutation.operator_name, mutation.occurrence, tuple(mutation.start_pos))
            if reason is not None and reason.startswith("equivalent"):
                db.set_result(item.job_id, WorkResult(output=reason, worker_outcome=WorkerOutcome.SKIPPED))
            else:
                again.append(item.job_id)
    with sqlite3.connect(db_path) as con:
        con.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in again])
    return config, db_path, len(again)


def run_target(
    target: Target, settings: dict, runner: Runner, workdir: Path, survivors_only: bool, sample: float | None
) -> dict:
    """Baseline, init, classify, exec, tally: one target's results.

    With ``survivors_only``, the target's last session is kept and only its survivors run again
    (after tests were added: a mutant killed before is still killed).
    """
    started = time.monotonic()
    base = subprocess.run(runner.command(target.tests, learn=True), cwd=ROOT, capture_output=True, text=True)
    baseline_s = time.monotonic() - started
    if base.returncode != 0:
        print(f"{target.name}: SKIPPED, its tests fail on the unmutated code ({base.returncode}):\n"
              f"{base.stdout[-3000:]}", flush=True)
        return {"name": target.name, "module": target.module, "killed": 0, "survived": [], "equivalent": 0,
                "timeouts": 0, "unsampled": 0, "seconds": time.monotonic() - started, "broken": True}
    timeout = baseline_s * settings.get("timeout_factor", 4) + settings.get("timeout_slack_s", 60)
    if survivors_only:
        config, db_path, to_run = reopen(target, workdir, timeout, runner.command(target.tests))
    else:
        config, db_path, to_run = prepare(target, settings, workdir, timeout, runner.command(target.tests), sample)
    print(f"{target.name}: {to_run} mutants, baseline {baseline_s:.1f} s, timeout {timeout:.0f} s", flush=True)
    backup = workdir / f"{target.name}.orig"
    shutil.copyfile(ROOT / target.module, backup)
    try:
        cosmic_ray("exec", str(config), str(db_path))
    finally:
        if (ROOT / target.module).read_bytes() != backup.read_bytes():
            shutil.copyfile(backup, ROOT / target.module)
            print(f"  restored {target.module} (a run was interrupted with a mutant in place)", flush=True)
    return tally(target, db_path, time.monotonic() - started)


def tally(target: Target, db_path: Path, seconds: float | None) -> dict:
    killed, survivors, equivalent, timeouts, unsampled = 0, [], 0, 0, 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                equivalent += result.output.startswith("equivalent")
                unsampled += result.output == NOT_SAMPLED
                continue
            if result.output and UNREACHABLE_MARK in result.output:
                sys.exit(f"{target.name}: a test run could not reach the mutation runner: {result.output[-500:]}")
            if result.test_outcome == TestOutcome.SURVIVED:
                (mutation,) = item.mutations
                survivors.append((mutation.start_pos[0], mutation.operator_name, result.diff or ""))
            elif result.test_outcome == TestOutcome.KILLED:
                killed += 1
                timeouts += result.output == "timeout"
            else:
                sys.exit(f"{target.name}: a mutant's run was {result.worker_outcome}/{result.test_outcome}: "
                         f"{(result.output or '')[-1000:]}")
    return {"name": target.name, "module": target.module, "killed": killed, "survived": sorted(survivors),
            "equivalent": equivalent, "timeouts": timeouts, "unsampled": unsampled, "seconds": seconds}


def report(results: list[dict], wall_s: float | None, diffs: bool) -> float:
    print("\n== survivors ==")
    for r in results:
        for line, operator, diff in r["survived"]:
            print(f"{r['module']}:{line}  {operator.removeprefix('core/')}")
            if diffs:
                print("".join(f"    {d}\n" for d in diff.splitlines() if d[:1] in "+-" and d[:3] not in ("+++", "---")))
    print("\n== score ==")
    total_k = total_n = 0
    for r in results:
        if r.get("broken"):
            print(f"{r['name']:<14} not run: its tests fail on the unmutated code")
            continue
        n = r["killed"] + len(r["survived"])
        total_k, total_n = total_k + r["killed"], total_n + n
        share = 100 * r["killed"] / n if n else 100.0
        sampled = f", {r['unsampled']} not in the sample" if r["unsampled"] else ""
        print(f"{r['name']:<14} {r['killed']:>4}/{n:<4} killed ({share:5.1f} %), {r['equivalent']} equivalent "
              f"left out{sampled}, {r['timeouts']} by timeout" + ("" if r["seconds"] is None else f", {r['seconds']:.0f} s"))
    score = 100 * total_k / total_n if total_n else 100.0
    print(f"{'all':<14} {total_k:>4}/{total_n:<4} killed ({score:5.1f} %)")
    if any(r["unsampled"] for r in results) and total_n:
        low, high = wilson(total_k, total_n)
        print(f"(a sample: 95 % interval of the share killed over all mutants {low:.1f}-{high:.1f} %)")
    if wall_s is not None:
        print(f"wall time {wall_s / 60:.1f} min")
    return score


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share k/n, in percent."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * (centre - half), 100 * (centre + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "mutation.toml")
    parser.add_argument("--target", action="append", default=[], help="only these targets (by name; repeatable)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".mutation", help="sessions, configs and logs")
    parser.add_argument("--fail-under", type=float, default=90.0, help="exit 1 below this share killed (%%)")
    parser.add_argument("--survivors", action="store_true",
                        help="rerun only the last session's survivors (after adding tests)")
    parser.add_argument("--sample", type=float, help=f"run only this share of each target's mutants "
                        f"(at least {SAMPLE_MIN}; a seeded draw): an estimate, for a busy machine")
    parser.add_argument("--report", action="store_true", help="only print the last sessions' results")
    parser.add_argument("--count", action="store_true", help="only count the mutants each target would run")
    parser.add_argument("--no-diffs", action="store_true", help="list survivors without their diffs")
    args = parser.parse_args()
    started = time.monotonic()
    settings, targets = load(args.config)
    if unknown := set(args.target) - {t.name for t in targets}:
        sys.exit(f"no target named {sorted(unknown)} in {args.config}")
    chosen = [t for t in targets if not args.target or t.name in args.target]
    if args.report:
        missing = [t.name for t in chosen if not (args.workdir / f"{t.name}.sqlite").exists()]
        if missing:
            sys.exit(f"no session in {args.workdir} for {missing}")
        report([tally(t, args.workdir / f"{t.name}.sqlite", None) for t in chosen], None, not args.no_diffs)
        return
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *(t.module for t in chosen)], cwd=ROOT,
                           capture_output=True, text=True).stdout
    if dirty.strip():
        sys.exit(f"uncommitted changes in the modules to mutate (commit or stash them first):\n{dirty}")
    args.workdir.mkdir(exist_ok=True)
    if args.count:  # in a scratch directory: the sessions in workdir stay as they are
        with tempfile.TemporaryDirectory() as scratch:
            for t in chosen:
                print(f"{t.name}: {prepare(t, settings, Path(scratch), 1, ['true'])[2]} mutants to run", flush=True)
        return
    runner = Runner(args.workdir)
    try:
        results = [run_target(t, settings, runner, args.workdir, args.survivors, args.sample) for t in chosen]
    finally:
        runner.close()
    score = report(results, time.monotonic() - started, not args.no_diffs)
    sys.exit(0 if score >= args.fail_under and not any(r.get("broken") for r in results) else 1)


if __name__ == "__main__":
    main()
