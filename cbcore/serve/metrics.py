"""``/metrics``: Prometheus series under vLLM's names, prefixed ``cbcore:``.

Every series carries ``model_name`` and ``policy`` (the scheduler's policy
mix, e.g. ``fcfs+token-budget+chunked-prefill+recompute``), so two servers
running two policies can be put side by side on one dashboard. Gauges come
from :meth:`Engine.load` after every step; latencies are observed when a
request finishes, from the engine's own timestamps.

Per class of request (``priority`` and ``client`` labels): TTFT and e2e
histograms, and deadline counts (finished requests that had a ``deadline_s``,
and those that met it: completed with e2e <= ``deadline_s``), with
``deadline_attainment`` their ratio since the server started (a request its
client aborted, or that failed before it was scheduled, is not counted;
one that failed in a step missed). Client ids come
from requests, so their labels are bounded: the first ``max_clients`` distinct
ids (default 16) keep their own label and every later one is counted as
``other``; likewise the first ``max_priorities`` priority values (default 8).
A series never changes its label, so a dashboard's lines stay continuous.

``engine_stalled`` is 1 while a call into the engine runs past
``serve.watchdog_s`` (:mod:`cbcore.serve.watchdog`), labelled with the plugin
and the method it stalled in (the scheduler's own plugins and the methods the
engine calls: a bounded set), and 0 again once the call has returned.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from cbcore.bench.classes import deadline_met
from cbcore.config import SLOTS, EngineConfig
from cbcore.engine import StepRecord
from cbcore.outputs import RequestOutput
from cbcore.scale.router import EngineLoad
from cbcore.serve.watchdog import Stall

PREFIX = "cbcore:"
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CONTENT_TYPE = CONTENT_TYPE_LATEST
MAX_CLIENT_LABELS = 16
MAX_PRIORITY_LABELS = 8
OTHER = "other"


class BoundedLabel:
    """The first ``limit`` distinct values keep their own label; every later one is ``other``."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"a label limit must be >= 0, got {limit}")
        self.limit = limit
        self.kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.kept:
            return value
        if len(self.kept) < self.limit and value != OTHER:
            self.kept.add(value)
            return value
        return OTHER


def policy_label(config: EngineConfig) -> str:
    """The policy mix in `--policy` form; a whole-scheduler plugin is named alone."""
    sched = config.scheduler
    if sched.name is not None:
        return sched.name
    return "+".join(getattr(sched, slot).name for slot in SLOTS)


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        policy: str,
        max_clients: int = MAX_CLIENT_LABELS,
        max_priorities: int = MAX_PRIORITY_LABELS,
    ) -> None:
        disable_created_metrics()  # no `_created` twin of every series, as vLLM does
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and friends
        labels = {"model_name": model_name, "policy": policy}
        names = list(labels)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=reg).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=reg).labels(**labels)

        self.running = gauge("num_requests_running", "Requests holding KV blocks (running).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out to host memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the device KV blocks in use (1 = full).")
        self.kv_used = gauge("kv_cache_blocks_used", "Device KV blocks in use.")
        self.kv_total = gauge("kv_cache_blocks_total", "Device KV blocks in the pool.")
        self.preemptions = counter("num_preemptions", "Preemptions since the server started.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests by reason.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens.", LATENCY_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per step.", TOKEN_BUCKETS
        )
        self._last = EngineLoad(0, 0, 0, 0, 0, 0)
        self.client_label = BoundedLabel(max_clients)
        self.priority_label = BoundedLabel(max_priorities)
        cls = [*names, "priority", "client"]
        self.class_ttft = Histogram(
            PREFIX + "class_time_to_first_token_seconds", "Arrival to first token, per class.", cls,
            buckets=LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.class_e2e = Histogram(
            PREFIX + "class_e2e_request_latency_seconds", "Arrival to finish, per class.", cls,
            buckets=E2E_BUCKETS, registry=reg,
        )  # fmt: skip
        self.deadline_total = Counter(
            PREFIX + "request_deadline", "Finished requests that had a deadline_s.", cls, registry=reg
        )
        self.deadline_met = Counter(
            PREFIX + "request_deadline_met",
            "Finished requests that completed within their deadline_s (e2e <= deadline_s).",
            cls,
            registry=reg,
        )
        self.attainment = Gauge(
            PREFIX + "deadline_attainment",
            "Share of finished requests with a deadline that met it, since the server started.",
            cls,
            registry=reg,
        )
        self._deadline_counts: dict[tuple[str, str], list[int]] = {}  # class -> [met, total]
        self.engine_stalled = Gauge(
            PREFIX + "engine_stalled",
            "1 while a call into the engine has run past serve.watchdog_s, by the plugin and method it is in.",
            [*names, "plugin", "method"],
            registry=reg,
        )

    def stalled(self, stall: Stall, begins: bool) -> None:
        """A stall listener: the series of the stall's plugin and method is 1 while it lasts."""
        plugin, method = stall.labels
        self.engine_stalled.labels(**self._labels, plugin=plugin, method=method).set(1 if begins else 0)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def on_load(self, load: EngineLoad) -> None:
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.swapped.set(load.num_swapped)
        self.kv_used.set(load.kv_blocks_used)
        self.kv_total.set(load.kv_blocks_total)
        self.kv_usage.set(load.kv_usage)
        self.preemptions.inc(max(0, load.num_preemptions_total - self._last.num_preemptions_total))
        self.prefix_queries.inc(
            max(0, load.prefix_cache_queries_tokens - self._last.prefix_cache_queries_tokens)
        )
        self.prefix_hits.inc(max(0, load.prefix_cache_hits_tokens - self._last.prefix_cache_hits_tokens))
        self._last = load

    def on_step(self, record: StepRecord) -> None:
        """A step listener (engine thread): step sizes, and the per-class series of what finished.

        A request finishes in a step that scheduled it (or failed it), so the step's plan holds
        the sequence and with it the request's priority, client and deadline.
        """
        if record.stats.num_tokens:
            self.iteration_tokens.observe(record.stats.num_tokens)
        finished = [o for o in record.outputs if o.finished]
        if not finished:
            return
        seqs = {s.seq.request_id: s.seq for s in record.output.scheduled}
        seqs.update((seq.request_id, seq) for seq in record.output.failed)
        for out in finished:
            seq = seqs.get(out.request_id)
            if seq is not None:
                self.observe_class(out, str(seq.priority), seq.client_id, seq.deadline_s)

    def observe_class(self, out: RequestOutput, priority: str, client: str, deadline_s: float | None) -> None:
        """One finished request's latencies and deadline under its (bounded) class labels."""
        labels = {**self._labels, "priority": self.priority_label(priority), "client": self.client_label(client)}
        m = out.metrics
        if m is not None and m.ttft is not None:
            self.class_ttft.labels(**labels).observe(m.ttft)
        if m is not None and m.e2e is not None:
            self.class_e2e.labels(**labels).observe(m.e2e)
        met = deadline_met(deadline_s, out)
        if met is None:
            return
        counts = self._deadline_counts.setdefault((labels["priority"], labels["client"]), [0, 0])
        counts[0] += met
        counts[1] += 1
        self.deadline_total.labels(**labels).inc()
        self.deadline_met.labels(**labels).inc(int(met))  # the series exists (at 0) from the first miss on
        self.attainment.labels(**labels).set(counts[0] / counts[1])

    def observe(self, outputs: list[RequestOutput], load: EngineLoad) -> None:
        """After every step (engine thread): load, token counts, latencies of what finished."""
        self.on_load(load)
        generated = 0
        for out in outputs:
            n = len(out.new_token_ids)
            generated += n
            if n and len(out.output_token_ids) == n:  # the request's first token
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            if out.finished:
                self._observe_finished(out)
        if generated:
            self.generation_tokens.inc(generated)

    def _observe_finished(self, out: RequestOutput) -> None:
        self.finished(out.finish_reason or "unknown")
        m = out.metrics
        if m is None:
            return
        for value, hist in ((m.ttft, self.ttft), (m.e2e, self.e2e), (m.queue_time, self.queue)):
            if value is not None:
                hist.observe(value)
        for gap in m.itl:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
