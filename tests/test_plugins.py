"""The plugin registry: sources, naming, errors, whole-scheduler replacement, `cb plugins`, docs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

import cbcore.backends
import cbcore.policies
from cbcore.cli.main import main as cb_main
from cbcore.cli.plugins import markdown_reference
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.plugins import PluginError, Registry, get_registry
from cbcore.scheduling.sampling_params import SamplingParams
from cbcore.testing import assert_equivalent, compare_greedy, random_prompts, reference_generate

ROOT = Path(__file__).resolve().parents[1]
EAGER = {"name": "eager"}
SMALL_KV = {"block_size": 4, "num_blocks": 32}  # tests that only build an engine need no big pool


def write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


QUEUE_PLUGIN = """
    from cbcore import QueuePolicy, hookimpl

    class {cls}(QueuePolicy):
        name = "{name}"

        def key(self, seq, now):
            return (-seq.num_prompt_tokens, seq.request_id)

    @hookimpl
    def cbcore_register_policies():
        return [{cls}]
"""


# -- sources -------------------------------------------------------------------------


def test_builtins_register_through_the_same_hook_as_outside_plugins() -> None:
    registry = get_registry()
    plugins = registry.pm.get_plugins()
    assert cbcore.policies in plugins and cbcore.backends in plugins
    hooked = {impl.plugin for impl in registry.pm.hook.cbcore_register_policies.get_hookimpls()}
    assert cbcore.policies in hooked
    for cls in cbcore.policies.BUILTIN_POLICIES:
        entry = registry.get(cls.kind, cls.name)
        assert entry.cls is cls and entry.origin == "built-in"
    assert {"eager", "sdpa"} <= set(registry.names("backend"))


def test_plugins_file_from_config_registers_its_policies(tmp_path: Path) -> None:
    path = write(tmp_path, "longest_first.py", QUEUE_PLUGIN.format(cls="LongestFirst", name="longest-first"))
    config = EngineConfig.model_validate(
        {"plugins": [path], "scheduler": {"queue": {"name": "longest-first"}}, "backend": EAGER}
    )
    entry = get_registry(tuple(config.plugins)).get("queue", "longest-first")
    assert entry.origin == f"path {path}"
    assert "longest-first" not in get_registry().names("queue")  # only where the config names it


def test_module_and_file_class_paths_name_a_plugin_directly(tmp_path: Path) -> None:
    path = write(tmp_path, "direct.py", QUEUE_PLUGIN.format(cls="Direct", name="direct"))
    registry = get_registry()
    assert registry.get("queue", f"{path}:Direct").cls.__name__ == "Direct"
    assert registry.get("queue", "cbcore.policies.fcfs:FCFS").cls is cbcore.policies.FCFS
    with pytest.raises(PluginError, match=r"is a queue plugin, not a budget plugin"):
        registry.get("budget", f"{path}:Direct")
    with pytest.raises(PluginError, match=r"has no attribute 'Nope'"):
        registry.get("queue", "cbcore.policies.fcfs:Nope")
    with pytest.raises(PluginError, match=r"does not exist"):
        registry.get("queue", f"{tmp_path}/missing.py:X")


def test_a_module_class_path_works_in_a_config_and_engine(tmp_path: Path, models: dict) -> None:
    path = write(tmp_path, "direct_engine.py", QUEUE_PLUGIN.format(cls="Direct", name="direct"))
    config = EngineConfig.model_validate(
        {"scheduler": {"queue": {"name": f"{path}:Direct"}}, "backend": EAGER, "kv_cache": SMALL_KV}
    )
    engine = Engine(models["llama"], None, config)
    assert type(engine.scheduler.door.queue).__name__ == "Direct"


def test_two_plugins_claiming_one_name_is_an_error_naming_both(tmp_path: Path) -> None:
    first = write(tmp_path, "one.py", QUEUE_PLUGIN.format(cls="MineA", name="mine"))
    second = write(tmp_path, "two.py", QUEUE_PLUGIN.format(cls="MineB", name="mine"))
    with pytest.raises(PluginError) as err:
        Registry((first, second))
    message = str(err.value)
    assert "two plugins claim queue 'mine'" in message
    assert re.search(rf"MineA \(path {re.escape(first)}\) and .*MineB \(path {re.escape(second)}\)", message)

    shadow = write(tmp_path, "shadow.py", QUEUE_PLUGIN.format(cls="MyFCFS", name="fcfs"))
    with pytest.raises(PluginError, match=r"cbcore\.policies\.fcfs\.FCFS \(built-in\) and .*MyFCFS \(path "):
        Registry((shadow,))


def test_one_file_reached_by_two_routes_is_one_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # e.g. a package installed with an entry point whose file is also listed under `plugins:`
    path = write(tmp_path, "twice.py", QUEUE_PLUGIN.format(cls="Twice", name="twice"))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = Registry(("twice", path))
    assert registry.get("queue", "twice").origin == "path twice"
    assert registry.names("queue").count("twice") == 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("class Bad:\n    name = 'bad'\n", "is not a cbcore plugin: it needs a `name` and a `kind`"),
        ("class Bad:\n    name = 'bad'\n    kind = 'queue'\n", "does not subclass cbcore.QueuePolicy"),
        (
            "from cbcore import QueuePolicy\nclass Bad(QueuePolicy):\n    name = 'bad'\n    Params = dict\n",
            "`Params` must be a pydantic BaseModel class",
        ),
    ],
)
def test_malformed_plugin_classes_are_refused_with_their_origin(
    tmp_path: Path, body: str, message: str
) -> None:
    source = (
        body + "\nfrom cbcore import hookimpl\n@hookimpl\ndef cbcore_register_policies():\n    return [Bad]\n"
    )
    path = write(tmp_path, "malformed.py", source)
    with pytest.raises(PluginError, match=re.escape(message)) as err:
        Registry((path,))
    assert path in str(err.value)


def test_a_broken_plugin_file_names_itself(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.py", "import not_a_module_anywhere\n")
    with pytest.raises(
        PluginError, match=r"broken\.py failed to import: No module named 'not_a_module_anywhere'"
    ):
        Registry((path,))


# -- bad configs -----------------------------------------------------------------------


def config_error(data: dict) -> str:
    with pytest.raises(ValidationError) as err:
        EngineConfig.model_validate({"backend": EAGER, **data})
    return str(err.value)


def test_unknown_policy_name_lists_the_known_ones() -> None:
    message = config_error({"scheduler": {"queue": {"name": "fifo"}}})
    assert re.search(r"scheduler\.queue: unknown queue plugin 'fifo'; known: (.*, )?fcfs, ", message)
    assert "priority" in message
    message = config_error({"scheduler": {"preemption": "evict"}})
    assert re.search(r"unknown preemption plugin 'evict'; known: (.*, )?recompute, (.*, )?swap\b", message)


def test_a_policy_in_the_wrong_slot_says_its_kind() -> None:
    message = config_error({"scheduler": {"queue": {"name": "token-budget"}}})
    assert "scheduler.queue: 'token-budget' is a budget plugin, not a queue plugin" in message
    message = config_error({"scheduler": {"prefill": "swap"}})
    assert "scheduler.prefill: 'swap' is a preemption plugin, not a prefill plugin" in message


def test_invalid_parameters_name_the_key_path() -> None:
    message = config_error({"scheduler": {"prefill": {"name": "chunked-prefill", "chunk_size": 0}}})
    assert "scheduler.prefill.chunk_size: Input should be greater than or equal to 1" in message
    message = config_error({"scheduler": {"queue": {"name": "priority", "aging": 3}}})
    assert "scheduler.queue.aging: Extra inputs are not permitted" in message
    message = config_error({"scheduler": {"preemption": {"name": "swap", "victim": "oldest"}}})
    assert "scheduler.preemption.victim: Input should be 'newest', 'lowest-priority'" in message
    message = config_error({"scheduler": {"budget": {"name": "static", "max_num_seqs": "many"}}})
    assert "scheduler.budget.max_num_seqs: Input should be a valid integer" in message


def test_a_missing_plugins_file_is_a_config_error(tmp_path: Path) -> None:
    message = config_error({"plugins": [str(tmp_path / "nope.py")]})
    assert f"plugin file {tmp_path / 'nope.py'} does not exist" in message


# -- a whole-scheduler replacement -------------------------------------------------------

SERIAL_SCHEDULER = """
    from collections import deque

    from pydantic import BaseModel, ConfigDict

    from cbcore import hookimpl
    from cbcore.scheduling.scheduler import ScheduledSeq, SchedulerOutput, SchedulerPlugin
    from cbcore.scheduling.sequence import SequenceStatus


    class SerialParams(BaseModel):
        model_config = ConfigDict(extra="forbid")
        newest_first: bool = False


    class Serial(SchedulerPlugin):
        \"\"\"One request at a time, whole prompt then its decodes.\"\"\"

        name = "serial"
        Params = SerialParams

        def __init__(self, params, blocks):
            super().__init__(params, blocks)
            self.queue = deque()
            self.current = None
            self.order = []

        def add(self, seq):
            self.queue.append(seq)


        def schedule(self):
            if self.current is None:
                take = self.queue.pop if self.params.newest_first else self.queue.popleft
                self.current = take()
                self.current.status = SequenceStatus.RUNNING
                self.order.append(self.current.request_id)
            seq = self.current
            n = seq.num_pending_tokens
            self.blocks.grow(seq, n)
            return SchedulerOutput(scheduled=[ScheduledSeq(seq, n)])

        def on_step_end(self, output, results):
            if self.current is not None and self.current.is_finished:
                self.blocks.free(self.current)
                self.current = None

        def abort(self, request_id):
            return None


    @hookimpl
    def cbcore_register_policies():
        return [Serial]
"""


def test_a_whole_scheduler_replacement_is_selected_by_config(tmp_path: Path, models: dict) -> None:
    path = write(tmp_path, "serial.py", SERIAL_SCHEDULER)
    config = EngineConfig.model_validate(
        {
            "plugins": [path],
            "scheduler": {"name": "serial", "params": {"newest_first": True}},
            "backend": EAGER,
            "kv_cache": SMALL_KV,
        }
    )
    model = models["llama"]
    prompts = random_prompts(4, 3, 20, seed=5)
    engine = Engine(model, None, config)
    assert type(engine.scheduler.plugin).__name__ == "Serial" and engine.scheduler.params.newest_first
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert_equivalent(compare_greedy(model, outputs, reference_generate(model, prompts, 6)))
    assert engine.scheduler.order == ["req-3", "req-2", "req-1", "req-0"]

    message = config_error({"plugins": [path], "scheduler": {"name": "serial", "params": {"newest": 1}}})
    assert "scheduler.newest: Extra inputs are not permitted" in message
    message = config_error({"scheduler": {"name": "fcfs"}})
    assert "scheduler: 'fcfs' is a queue plugin, not a scheduler plugin" in message


# -- entry points, in a fresh process --------------------------------------------------------

FRESH_PROCESS = """
import json, sys
from cbcore.config import EngineConfig
from cbcore.engine import Engine
from cbcore.plugins import get_registry
from cbcore.testing import tiny_model

config = EngineConfig.from_file(sys.argv[1])
registry = get_registry(tuple(config.plugins))
queue = Engine(tiny_model("llama"), None, config).scheduler.door.queue
print(json.dumps({
    "origins": {e.name: e.origin for e in registry.entries("queue")},
    "queue_class": f"{type(queue).__module__}.{type(queue).__qualname__}",
    "weights": queue.params.weights,
}))
"""


def test_contrib_plugins_are_found_through_entry_points_by_a_fresh_process(tmp_path: Path) -> None:
    config = tmp_path / "vtc.yaml"
    config.write_text(
        textwrap.dedent(
            """
            scheduler:
              queue: {name: vtc, weights: {alice: 2.0}}
              budget: {name: token-budget, max_num_seqs: 4, max_num_batched_tokens: 16}
            backend: {name: eager}
            kv_cache: {block_size: 4, num_blocks: 12}
            """
        )
    )
    script = tmp_path / "fresh.py"
    script.write_text(FRESH_PROCESS)
    proc = subprocess.run(
        [sys.executable, str(script), str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("sjf", "vtc", "mlfq"):
        assert result["origins"][name] == f"entry point cbcore-{name}", (
            f"{name} is not installed: pip install -e contrib/{name}"
        )
    assert result["queue_class"] == "cbcore_vtc.policy.VirtualTokenCounter"
    assert result["weights"] == {"alice": 2.0}


def run_with_distribution(tmp_path: Path, dist: str, entry: str, module: str, source: str, script: str) -> dict:
    """Run ``script`` in a fresh process beside an installed distribution ``dist`` whose ``cbcore`` entry
    point ``entry`` names ``module`` (with ``source``); the JSON of its last printed line."""
    site = tmp_path / "site"
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cbcore]\n{entry}\n")
    (site / f"{module}.py").write_text(source)
    (tmp_path / "fresh.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "fresh.py")], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


BROKEN_ENTRY_POINT = """
import json
from cbcore.plugins import get_registry
registry = get_registry()
print(json.dumps({"broken": registry.broken, "fcfs": registry.get("queue", "fcfs").origin,
                  "vtc": registry.get("queue", "vtc").origin}))
"""


def test_a_broken_entry_point_is_named_and_skipped_in_a_fresh_process(tmp_path: Path) -> None:
    """A third-party package whose plugin module fails to import must not take the registry down."""
    result = run_with_distribution(
        tmp_path, "cbcore-broken", "broken = cbcore_broken_plugin", "cbcore_broken_plugin",
        "raise ImportError('needs a package that is not installed')\n", BROKEN_ENTRY_POINT,
    )  # fmt: skip
    [(name, why)] = result["broken"]
    assert name.startswith("broken (cbcore_broken_plugin, entry point cbcore-broken)")
    assert "needs a package that is not installed" in why
    assert (result["fcfs"], result["vtc"]) == ("built-in", "entry point cbcore-vtc")


LAZY_BACKENDS = """
import json, sys
from cbcore.cli.main import main
from cbcore.plugins import get_registry
code = main(["simulate", "--profile", "a100-llama-2-7b-tp1", "--workload", "poisson:n=8,rate=4,seed=1",
             "--policy", "priority+chunked", "--no-progress"])
registry = get_registry()
before = {"code": code, "torch": "torch" in sys.modules, "broken": list(registry.broken)}
sdpa = registry.get("backend", "sdpa").origin
print(json.dumps({**before, "after": registry.broken, "sdpa": sdpa, "torch_after": "torch" in sys.modules}))
"""


def test_backends_load_when_first_looked_up_and_a_failing_backend_hook_is_named(tmp_path: Path) -> None:
    """Backends import torch: `cb simulate` runs no model, so it never loads them (1.5 s and 200 MB less).
    A package whose backend hook fails is skipped then, named like an entry point that fails to import."""
    hook = "from cbcore.plugins import hookimpl\n\n@hookimpl\ndef cbcore_register_backends():\n    raise RuntimeError('no such device')\n"
    result = run_with_distribution(
        tmp_path, "cbcore-badbackend", "badbackend = cbcore_badbackend", "cbcore_badbackend", hook, LAZY_BACKENDS
    )
    assert (result["code"], result["torch"], result["broken"]) == (0, False, [])
    [(name, why)] = result["after"]
    assert name.startswith("cbcore_badbackend (entry point cbcore-badbackend)") and "no such device" in why
    assert (result["sdpa"], result["torch_after"]) == ("built-in", True)


# -- cb plugins --------------------------------------------------------------------------


def test_cb_plugins_table_lists_kinds_origins_params_and_availability(capsys: pytest.CaptureFixture) -> None:
    assert cb_main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^queue\s+priority\s+built-in", out, re.M)
    assert re.search(r"^\s+aging_s: float \| None = None\s+Every aging_s seconds", out, re.M)
    assert re.search(r"^preemption\s+swap\s+built-in", out, re.M)
    assert re.search(r"^backend\s+eager\s+built-in\s+cpu: available", out, re.M)
    assert re.search(r"^queue\s+vtc\s+entry point cbcore-vtc", out, re.M)


def test_cb_plugins_json(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    path = write(tmp_path, "listed.py", QUEUE_PLUGIN.format(cls="Listed", name="listed"))
    config = tmp_path / "c.yaml"
    config.write_text(f"plugins: [{path}]\n")
    assert cb_main(["plugins", "--json", "--config", str(config)]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[("queue", "listed")]["origin"] == f"path {path}"
    chunked = {p["name"]: p for p in rows[("prefill", "chunked-prefill")]["params"]}
    assert chunked["chunk_size"]["default"] is None and chunked["max_long_prefills"]["default"] == 1
    assert "order" not in chunked  # the phase order is the scheduler's (scheduler.order)
    assert rows[("budget", "token-budget")]["summary"].startswith("One token budget")
    for (kind, _), row in rows.items():
        if kind == "backend":
            assert set(row["available"]) >= {"cpu"}
            for device, ok in row["available"].items():
                assert ok == (device not in row["unavailable_reason"])
    assert rows[("backend", "eager")]["available"]["cpu"] is True


def test_docs_reference_is_generated_from_the_params_models() -> None:
    doc = (ROOT / "docs" / "policies.md").read_text()
    begin, end = "<!-- begin: cb plugins --markdown -->\n", "<!-- end: cb plugins --markdown -->"
    embedded = doc[doc.index(begin) + len(begin) : doc.index(end)]
    registry = get_registry()
    builtin = [e for e in registry.entries() if e.origin == "built-in" and e.kind != "backend"]
    from cbcore.plugins import KINDS

    builtin.sort(key=lambda e: (KINDS.index(e.kind), e.name))
    assert embedded == markdown_reference(builtin), "regenerate the section with `cb plugins --markdown`"
    for entry in builtin:
        for field in entry.cls.Params.model_fields:
            assert f"| `{field}` |" in embedded


def doc_block(first_line: str) -> str:
    """The python block of docs/policies.md that starts with ``first_line``."""
    doc = (ROOT / "docs" / "policies.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if b.startswith(first_line))


def test_docs_tutorial_plugin_works(tmp_path: Path, models: dict, references: dict) -> None:
    """The tutorial's plugin file, loaded through `plugins:` and checked for equivalence."""
    source = doc_block("# my_policy.py")
    assert 25 <= len(source.splitlines()) <= 40
    path = tmp_path / "my_policy.py"
    path.write_text(source)
    config = EngineConfig.model_validate(
        {
            "plugins": [str(path)],
            "scheduler": {
                "queue": {"name": "shortest-prompt", "aging_s": 2.0},
                "budget": {"name": "token-budget", "max_num_seqs": 6, "max_num_batched_tokens": 32},
            },
            "kv_cache": {"block_size": 4, "num_blocks": 48},
            "backend": EAGER,
        }
    )
    from support import CAPS, PROMPTS

    model = models["llama"]
    engine = Engine(model, None, config)
    idx = range(8)
    outputs = engine.generate(
        [PROMPTS[i] for i in idx], [SamplingParams(max_new_tokens=CAPS[i]) for i in idx]
    )
    assert_equivalent(compare_greedy(model, outputs, [references["llama"][i] for i in idx]))
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_partial_prefills > 0


def test_docs_tutorial_model_free_test_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 4 of the tutorial: its FakeRun test, run against the tutorial's plugin file."""
    (tmp_path / "my_policy.py").write_text(doc_block("# my_policy.py"))
    snippet = doc_block("from cbcore.policies import WholePrompt")
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec(compile(snippet, "policies.md step 4", "exec"), namespace)
    namespace["test_short_prompts_go_first"]()


def test_docs_events_example_keeps_its_state_on_the_policy(tmp_path: Path) -> None:
    """The events example of docs/policies.md: state keyed by request id, counted in on_step_end, dropped in
    on_finish; recomputed tokens count, so a preempted request has been served more than its tokens."""
    from cbcore.testing import FakeRun, budget

    path = tmp_path / "least_attained.py"
    path.write_text(doc_block("# least_attained.py"))
    registry = get_registry((str(path),))
    policy = registry.create("queue", "least-attained", {}, "scheduler.queue")
    served_at_finish: dict[str, int] = {}
    on_finish = policy.on_finish

    def record(seq, now):  # what the policy had counted when the request ended
        served_at_finish[seq.request_id] = policy.served[seq.request_id]
        on_finish(seq, now)

    policy.on_finish = record
    run = FakeRun(policy, budget(max_seqs=4, max_tokens=64), num_blocks=12)
    for i, prompt_len in enumerate([20, 16, 12, 8]):
        run.add(f"r{i}", prompt_len, 12)
    run.run()
    assert run.sched.num_preemptions > 0 and policy.served == {}
    for rid, seq in run.seqs.items():
        own = seq.num_prompt_tokens + seq.num_output_tokens - 1  # the last token is never fed back
        assert served_at_finish[rid] >= own and (served_at_finish[rid] > own) == (seq.num_preemptions > 0), rid
