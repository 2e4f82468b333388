"""Virtual Token Counter (VTC): fair share of served tokens across clients.

From "Fairness in Serving Large Language Models" (Sheng et al., OSDI'24). Each
client has a counter of the tokens it has been served, weighted by token kind
(prompt or generated) and divided by the client's share weight. The scheduler
always serves the backlogged client whose counter is smallest, so two clients
that both keep the server busy receive the same weighted service, whatever
their arrival pattern; the gap between their counters stays bounded.

A client that returns after being idle must not cash in service it did not
ask for: its counter is lifted to the smallest counter among the clients that
are backlogged (or, when none is, to the counter of the last client that
left).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cbcore import QueuePolicy, SequenceView, StepResult


class VTCParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_weight: float = Field(1.0, ge=0, description="Counter cost of one prompt token served.")
    output_weight: float = Field(
        2.0,
        ge=0,
        description="Counter cost of one generated token (the paper's default cost model: 1 and 2).",
    )
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="Share weight per client_id (default 1): a client of weight 2 is owed twice the service.",
    )
    preempt_running: bool = Field(
        False,
        description="A waiting request that finds no free slot or KV blocks may evict running requests "
        "of clients with a strictly larger counter.",
    )

    @field_validator("weights")
    @classmethod
    def _positive(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {c: w for c, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"client weights must be > 0, got {bad}")
        return weights


class VirtualTokenCounter(QueuePolicy):
    """Serve the backlogged client with the smallest weighted count of served tokens."""

    name = "vtc"
    Params = VTCParams

    def __init__(self, params: VTCParams | None = None) -> None:
        super().__init__(params)
        self.counters: dict[str, float] = {}
        self._unfinished: dict[str, int] = {}  # client -> requests not yet finished (its backlog)
        self._prompt_charged: dict[str, int] = {}  # request -> prompt tokens already charged
        self._last_left = 0.0  # counter of the last client whose backlog emptied

    def weight(self, client_id: str) -> float:
        return self.params.weights.get(client_id, 1.0)

    def counter(self, client_id: str) -> float:
        return self.counters.get(client_id, 0.0)

    # -- events --------------------------------------------------------------

    def on_arrival(self, seq: SequenceView, now: float) -> None:
        client = seq.client_id
        if not self._unfinished.get(client):
            active = [self.counter(c) for c, n in self._unfinished.items() if n]
            floor = min(active) if active else self._last_left
            self.counters[client] = max(self.counter(client), floor)
        self._unfinished[client] = self._unfinished.get(client, 0) + 1
        self._prompt_charged[seq.request_id] = 0

    def on_step_end(self, results: Seq[StepResult], now: float) -> None:
        for r in results:
            seq = r.seq
            charged = self._prompt_charged.get(seq.request_id, 0)
            # Prompt tokens count once: a recompute after preemption is not new service.
            prompt_done = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            new_prompt = max(0, prompt_done - charged)
            self._prompt_charged[seq.request_id] = charged + new_prompt
            cost = new_prompt * self.params.input_weight
            if r.new_token is not None:
                cost += self.params.output_weight
            self.counters[seq.client_id] = self.counter(seq.client_id) + cost / self.weight(seq.client_id)

    def on_finish(self, seq: SequenceView, now: float) -> None:
        self._prompt_charged.pop(seq.request_id, None)
        left = self._unfinished.get(seq.client_id, 0) - 1
        self._unfinished[seq.client_id] = max(0, left)
        if left <= 0:
            self._last_left = self.counter(seq.client_id)

    # -- ordering ------------------------------------------------------------

    def key(self, seq: SequenceView, now: float) -> tuple[float, float, str]:
        return (self.counter(seq.client_id), seq.arrival_time, seq.request_id)

    def order(self, seqs: Seq[SequenceView], now: float) -> list[SequenceView]:
        """Interleave clients as if counters were charged as each one is served.

        Sorting by the counters alone would admit a whole batch from the
        client that is behind, overshooting it; charging each pick's expected
        cost (its uncharged prompt and one generated token) as it is taken
        hands the next slot to whoever is then behind.
        """
        queues: dict[str, list[SequenceView]] = {}
        for seq in sorted(seqs, key=lambda s: (s.arrival_time, s.request_id)):
            queues.setdefault(seq.client_id, []).append(seq)
        tentative = {c: self.counter(c) for c in queues}
        heads = dict.fromkeys(queues, 0)
        ordered: list[SequenceView] = []
        while len(ordered) < len(seqs):
            client = min(
                (c for c in queues if heads[c] < len(queues[c])),
                key=lambda c: (tentative[c], queues[c][heads[c]].arrival_time, c),
            )
            seq = queues[client][heads[client]]
            heads[client] += 1
            ordered.append(seq)
            uncharged = seq.num_prompt_tokens - self._prompt_charged.get(seq.request_id, 0)
            cost = max(0, uncharged) * self.params.input_weight + self.params.output_weight
            tentative[client] += cost / self.weight(client)
        return ordered

    def outranks(self, a: SequenceView, b: SequenceView, now: float) -> bool:
        return self.params.preempt_running and self.counter(a.client_id) < self.counter(b.client_id)
