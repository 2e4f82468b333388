"""Routers: the fifth plugin kind, its checks, and what each built-in does with a replica set."""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from cbcore import ReplicaView, Router, RouteRequest, RouterError
from cbcore.plugins import PluginError, get_registry
from cbcore.scale.router import checked_choice
from cbcore.serve.config import Settings


@dataclass(frozen=True)
class Load:
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100


def make(name: str, **params: object) -> Router:
    return get_registry().create("router", name, dict(params), "router")


def views(*in_flight: int, loads: list[Load] | None = None) -> list[ReplicaView]:
    loads = loads or [Load()] * len(in_flight)
    return [ReplicaView(f"r{i}", load, 0.0, n) for i, (n, load) in enumerate(zip(in_flight, loads, strict=True))]


def req(i: int, tokens: tuple[int, ...] = ()) -> RouteRequest:
    return RouteRequest(f"q{i}", tokens)


def test_builtin_routers_are_registered_as_kind_router() -> None:
    builtin = sorted(e.name for e in get_registry().entries("router") if e.origin == "built-in")
    assert builtin == ["least-loaded", "power-of-two", "prefix-affinity", "round-robin"]
    assert Settings().router.name == "least-loaded"


def test_config_names_the_router_and_checks_its_params() -> None:
    cfg = Settings.from_dict({"router": {"name": "power-of-two", "seed": 3}})
    assert cfg.router.params == {"seed": 3}
    with pytest.raises(ValueError, match=r"router\.by"):
        Settings.from_dict({"router": {"name": "least-loaded", "by": "vibes"}})
    with pytest.raises(ValueError, match="'fcfs' is a queue plugin, not a router plugin"):
        Settings.from_dict({"router": "fcfs"})


def test_round_robin_takes_turns_and_survives_a_replica_leaving() -> None:
    rr = make("round-robin")
    three = views(0, 0, 0)
    assert [checked_choice(rr, req(i), three) for i in range(4)] == ["r0", "r1", "r2", "r0"]
    without_r1 = [v for v in three if v.replica_id != "r1"]
    assert [checked_choice(rr, req(i), without_r1) for i in range(3)] == ["r2", "r0", "r2"]


@pytest.mark.parametrize(
    ("by", "loads", "in_flight", "expected"),
    [
        ("in-flight", [Load(), Load(), Load()], (3, 1, 2), "r1"),
        ("queue", [Load(5, 5), Load(0, 9), Load(1, 1)], (0, 0, 9), "r2"),
        ("kv", [Load(kv_blocks_used=50), Load(kv_blocks_used=10), Load(kv_blocks_used=90)], (0, 5, 0), "r1"),
    ],
)
def test_least_loaded_reads_the_measure_it_is_told(by: str, loads: list[Load], in_flight, expected) -> None:
    assert checked_choice(make("least-loaded", by=by), req(0), views(*in_flight, loads=loads)) == expected


def test_least_loaded_before_any_report_falls_back_to_in_flight() -> None:
    replicas = [ReplicaView("a", None, 0.0, 2), ReplicaView("b", None, 0.0, 1)]
    assert checked_choice(make("least-loaded", by="queue"), req(0), replicas) == "b"


def test_power_of_two_never_picks_the_busiest_and_spreads_over_the_rest() -> None:
    p2 = make("power-of-two", seed=7)
    replicas = views(0, 1, 2, 9)
    picks = Counter(checked_choice(p2, req(i), replicas) for i in range(600))
    assert picks["r3"] == 0  # whichever other replica is drawn beside it is less loaded
    # r0 wins every draw it is in (1/2 of them), r1 those with r2/r3 only (1/3), r2 with r3 only (1/6).
    assert picks["r0"] > picks["r1"] > picks["r2"] > 0
    assert make("power-of-two", seed=7).choose(req(0), replicas) == make("power-of-two", seed=7).choose(
        req(0), replicas
    )


def test_prefix_affinity_keeps_a_prefix_on_one_replica_and_spreads_different_ones() -> None:
    pa = make("prefix-affinity", block_size=4, num_blocks=2)
    replicas = views(0, 0, 0, 0)
    system = (11, 12, 13, 14, 15, 16, 17, 18)
    first = {checked_choice(pa, req(i, (*system, i, i + 1)), replicas) for i in range(20)}
    assert len(first) == 1  # tokens past the key's two blocks do not matter
    owners = Counter(checked_choice(pa, req(i, tuple(range(i, i + 8))), replicas) for i in range(400))
    assert set(owners) == {"r0", "r1", "r2", "r3"} and min(owners.values()) > 50


def test_prefix_affinity_moves_only_the_keys_of_a_replica_that_left() -> None:
    pa = make("prefix-affinity", block_size=4, num_blocks=1)
    prompts = [tuple(range(i, i + 4)) for i in range(300)]
    before = [checked_choice(pa, req(i, p), views(0, 0, 0)) for i, p in enumerate(prompts)]
    two = [v for v in views(0, 0, 0) if v.replica_id != "r2"]
    after = [checked_choice(pa, req(i, p), two) for i, p in enumerate(prompts)]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == "r2" for b, _ in moved)


def test_prefix_affinity_gives_way_to_short_prompts_and_to_imbalance() -> None:
    pa = make("prefix-affinity", block_size=4, num_blocks=1, max_imbalance=2)
    prompt = (1, 2, 3, 4)
    home = checked_choice(pa, req(0, prompt), views(0, 0))
    other = "r1" if home == "r0" else "r0"
    loaded = [ReplicaView(home, None, 0.0, 3), ReplicaView(other, None, 0.0, 0)]
    assert checked_choice(pa, req(1, prompt), sorted(loaded, key=lambda r: r.replica_id)) == other
    assert checked_choice(pa, req(2, (1, 2, 3)), views(5, 1)) == "r1"  # under one block: least in flight


class Wrong(Router):
    name = "wrong"

    def choose(self, request, replicas):
        return "nowhere"


def test_a_router_answer_outside_the_candidates_is_an_error_naming_it() -> None:
    with pytest.raises(RouterError, match=r"Wrong \('wrong'\) chose 'nowhere' for request 'q0'"):
        checked_choice(Wrong(), req(0), views(0, 0))
    with pytest.raises(RouterError, match="no replica is available"):
        checked_choice(make("round-robin"), req(0), [])


def test_rank_puts_the_choice_first_then_the_least_busy() -> None:
    rr = make("round-robin")
    assert rr.rank(req(0), views(4, 1, 0)) == ["r0", "r2", "r1"]


def test_a_router_from_a_plugin_file_is_named_in_the_config(tmp_path: Path) -> None:
    path = tmp_path / "my_router.py"
    path.write_text(
        textwrap.dedent(
            """
            from cbcore import Router, hookimpl

            class Last(Router):
                name = "last"

                def choose(self, request, replicas):
                    return replicas[-1].replica_id

            @hookimpl
            def cbcore_register_policies():
                return [Last]
            """
        )
    )
    cfg = Settings.from_dict({"plugins": [str(path)], "router": "last"})
    router = get_registry(tuple(cfg.plugins)).create("router", "last", {}, "router")
    assert checked_choice(router, req(0), views(0, 0, 0)) == "r2"
    with pytest.raises(PluginError, match=r"does not subclass cbcore\.Router"):
        path2 = tmp_path / "bad_router.py"
        path2.write_text("class Bad:\n    name = 'bad'\n    kind = 'router'\n")
        get_registry().get("router", f"{path2}:Bad")
