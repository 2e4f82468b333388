"""/metrics per class of request: deadline attainment and TTFT / e2e histograms by priority and client.

Scraped from a real `cb serve` subprocess (the shared tiny server); the label
bound is checked in process too, where the order of clients is known.
"""

from __future__ import annotations

import re

import httpx
from support import SERVE_KEY

from cbcore.outputs import RequestMetrics, RequestOutput
from cbcore.serve.metrics import MAX_CLIENT_LABELS, OTHER, BoundedLabel, ServerMetrics

HEADERS = {"Authorization": f"Bearer {SERVE_KEY}"}


def complete(url: str, model: str, **fields: object) -> None:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, **fields}
    r = httpx.post(url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text


def series(text: str, name: str) -> dict[tuple[str, str], float]:
    """``{(priority, client): value}`` of one labelled series."""
    found = {}
    for line in text.splitlines():
        if line.startswith(f"cbcore:{name}{{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            found[(labels["priority"], labels["client"])] = float(line.rsplit(" ", 1)[1])
    return found


def test_deadline_attainment_and_class_latencies_are_scraped_per_priority_and_client(tiny_server):
    url = tiny_server.url
    model = httpx.get(url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    complete(url, model, user="dl-client", priority=2, deadline_s=600.0)  # met
    complete(url, model, user="dl-client", priority=2, deadline_s=1e-6)  # missed: no request is that fast
    complete(url, model, user="dl-client", priority=2, deadline_s=600.0)  # met
    complete(url, model, user="no-deadline", priority=5)
    text = httpx.get(url + "/metrics").text
    key = ("2", "dl-client")
    assert series(text, "request_deadline_total")[key] == 3
    assert series(text, "request_deadline_met_total")[key] == 2
    assert abs(series(text, "deadline_attainment")[key] - 2 / 3) < 1e-9
    assert ("5", "no-deadline") not in series(text, "request_deadline_total")  # it had no deadline
    for name in ("class_time_to_first_token_seconds_count", "class_e2e_request_latency_seconds_count"):
        counts = series(text, name)
        assert counts[key] == 3 and counts[("5", "no-deadline")] == 1, name
    policy = 'policy="fcfs+token-budget+chunked-prefill+recompute"'
    assert all(policy in line for line in text.splitlines() if line.startswith("cbcore:deadline_attainment{"))


def test_client_labels_are_bounded_on_the_server(tiny_server):
    url = tiny_server.url
    model = httpx.get(url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]
    clients = [f"bulk-{i:02d}" for i in range(MAX_CLIENT_LABELS + 4)]
    for client in clients:
        complete(url, model, user=client, max_tokens=1)
    labels = {c for _, c in series(httpx.get(url + "/metrics").text, "class_e2e_request_latency_seconds_count")}
    assert OTHER in labels
    assert len(labels - {OTHER}) == MAX_CLIENT_LABELS  # other tests' clients may have taken some places
    assert not set(clients[-4:]) & labels  # the last ones always arrive after the bound is reached


def finished(request_id: str, e2e: float) -> RequestOutput:
    m = RequestMetrics(0.0, 0.0, e2e / 2, (e2e / 2, e2e), e2e, 0, 3, 2)
    return RequestOutput(request_id, [1, 2, 3], [4, 5], [5], True, "length", metrics=m)


def test_the_first_clients_keep_their_labels_and_later_ones_are_other() -> None:
    bound = BoundedLabel(2)
    assert [bound(c) for c in ("a", "b", "c", "a", OTHER, "d")] == ["a", "b", OTHER, "a", OTHER, OTHER]
    metrics = ServerMetrics("m", "edf", max_clients=1, max_priorities=1)
    metrics.observe_class(finished("r1", 1.0), "0", "alice", deadline_s=2.0)
    metrics.observe_class(finished("r2", 3.0), "1", "bob", deadline_s=2.0)  # late, and both labels bounded
    text = metrics.render().decode()
    assert series(text, "request_deadline_total") == {("0", "alice"): 1, (OTHER, OTHER): 1}
    assert series(text, "deadline_attainment") == {("0", "alice"): 1.0, (OTHER, OTHER): 0.0}
