"""Synthetic workloads: gamma-process arrivals, length distributions, clients and priorities.

Arrivals follow vLLM's benchmark: inter-arrival gaps are drawn from a gamma
distribution with shape ``burstiness`` and mean ``1 / rate``, so burstiness 1
is a Poisson process, smaller values are burstier, larger ones more regular,
and ``rate=inf`` sends everything at t=0. The first request arrives at t=0.

Prompts are token ids drawn uniformly from the model's vocabulary (special
tokens excluded); what is measured is the serving of those lengths, not what
the text says. ``ignore_eos`` defaults to true so each request produces the
output length it was drawn with.

``lengths=arxiv-summarization`` draws each request's (prompt, output) pair
from a measured table instead (:mod:`cbcore.bench.length_tables`).

Two keys make prompts repeat themselves, as chat and agent traffic does:

* ``system_len=512`` starts every prompt with a system prompt of that many
  tokens (``system_prompts=K`` distinct ones, client ``i`` of ``clients``
  using prompt ``i mod K``); the drawn input length is the user part after it.
* ``turns=T`` makes each of the ``n`` arrivals a conversation of ``T`` turns,
  closed-loop: turn ``k+1`` is sent ``think_s`` seconds after turn ``k``'s
  answer is complete, and its prompt is turn ``k``'s prompt, that answer and a
  new user message of the drawn input length (see ``BenchRequest.follows``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence as Seq
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cbcore.bench.length_tables import TABLES, length_table
from cbcore.bench.workload import BenchRequest, Workload, WorkloadError
from cbcore.cli.config_files import format_validation_error

GENERATORS = ("poisson", "gamma")

# Means of the ShareGPT conversations that vLLM's benchmark samples, after its
# filter (prompts of 4..1024 tokens); both are long-tailed.
SHAREGPT_INPUT_MEAN = 220
SHAREGPT_OUTPUT_MEAN = 200


class ClassSpec(BaseModel):
    """Who sends each request and how urgent it is: the keys a generator and a trace share.

    Each request's client and priority are drawn by weight, and its deadline
    (when its priority class has one) uniformly around the class's mean.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    clients: dict[str, float] = Field(default_factory=lambda: {"default": 1.0})
    priorities: dict[int, float] = Field(default_factory=lambda: {0: 1.0})
    deadlines: dict[int, float] = Field(
        default_factory=dict,
        description="Mean deadline_s per priority class (e.g. 0:2/1:30); classes not named get none.",
    )
    deadline_spread: float = Field(
        0.5, ge=0, lt=1, description="Each deadline is drawn uniformly in mean * [1 - spread, 1 + spread]."
    )

    @field_validator("deadlines")
    @classmethod
    def _positive_deadlines(cls, value: dict) -> dict:
        if any(not 0 < d < math.inf for d in value.values()):
            raise ValueError("deadlines must be positive, finite seconds")
        return value

    @field_validator("clients", "priorities")
    @classmethod
    def _positive_weights(cls, value: dict) -> dict:
        if not value or any(w <= 0 for w in value.values()):
            raise ValueError("weights must be positive")
        return value

    def draw_class(self, who: random.Random, deadline_rng: random.Random) -> tuple[str, int, float | None]:
        """One request's client, priority and deadline (None: its class has none)."""
        client = who.choices(list(self.clients), list(self.clients.values()))[0]
        priority = who.choices(list(self.priorities), list(self.priorities.values()))[0]
        mean = self.deadlines.get(priority)
        spread = self.deadline_spread
        deadline = None if mean is None else mean * deadline_rng.uniform(1 - spread, 1 + spread)
        return client, priority, deadline


#: The keys whose values are ``name:weight/name:weight`` lists.
WEIGHT_KEYS = ("clients", "priorities", "deadlines")


class GeneratorSpec(ClassSpec):
    """``poisson:key=value,...``; every key has a default."""

    n: int = Field(64, ge=1, description="Number of requests.")
    rate: float = Field(math.inf, gt=0, description="Mean arrivals per second; inf: all at t=0.")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape of inter-arrival gaps; 1 = Poisson.")
    lengths: Literal["fixed", "uniform", "sharegpt", "arxiv-summarization"] = "sharegpt"
    input_len: int | None = Field(None, ge=1, description="Mean prompt length (default per distribution).")
    output_len: int | None = Field(None, ge=1, description="Mean output length (default per distribution).")
    range_ratio: float = Field(0.5, ge=0, lt=1, description="uniform: lengths in [L(1-r), L(1+r)].")
    sigma: float = Field(1.0, gt=0, le=3, description="sharegpt: log-normal shape (larger: longer tail).")
    max_input: int = Field(1024, ge=1, description="Longest prompt kept (sharegpt tail is truncated).")
    max_output: int = Field(1024, ge=1, description="Longest output kept.")
    ignore_eos: bool = True
    seed: int = 0
    system_len: int = Field(0, ge=0, description="Tokens of a system prompt every prompt starts with.")
    system_prompts: int = Field(1, ge=1, description="Distinct system prompts; client i uses i mod this.")
    turns: int = Field(1, ge=1, description="Turns per conversation (closed-loop after the first).")
    think_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="Pause after an answer before the next turn.")

    @property
    def means(self) -> tuple[int, int]:
        default = (SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN) if self.lengths == "sharegpt" else (128, 128)
        return (self.input_len or default[0], self.output_len or default[1])


def is_generator(spec: str) -> bool:
    """True for a generator spec, which is validated on the spot (prompts are drawn later)."""
    if spec.split(":", 1)[0] not in GENERATORS:
        return False
    parse_spec(spec)
    return True


def spec_items(spec: str, body: str) -> dict[str, object]:
    """``a=1,clients=x:3/y:1`` -> {key: value}, weighted keys parsed; a key given twice is an error, not the last one kept."""
    data: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise WorkloadError(f"workload {spec!r}: expected key=value, got {item!r}")
        key = key.strip()
        if key in data:
            raise WorkloadError(f"workload {spec!r}: {key} is given twice")
        data[key] = weights(spec, key, value) if key in WEIGHT_KEYS else value.strip()
    return data


def parse_spec(spec: str) -> tuple[str, GeneratorSpec]:
    """``poisson:n=64,rate=2,clients=a:3/b:1,priorities=0/1`` -> (kind, validated spec)."""
    kind, _, body = spec.partition(":")
    if kind not in GENERATORS:
        raise WorkloadError(f"workload {spec!r}: unknown generator {kind!r}; known: {', '.join(GENERATORS)}")
    try:
        return kind, GeneratorSpec.model_validate(spec_items(spec, body))
    except ValidationError as exc:
        raise WorkloadError(f"workload {spec!r}: {format_validation_error(exc)}") from None


def weights(spec: str, key: str, value: str) -> dict[str, str]:
    """``a:3/b:1`` -> {a: 3, b: 1}; a bare name has weight 1."""
    out: dict[str, str] = {}
    for part in filter(None, value.split("/")):
        name, _, weight = part.partition(":")
        if not name.strip():
            raise WorkloadError(f"workload {spec!r}: {key}: empty name in {value!r}")
        out[name.strip()] = weight.strip() or "1"
    return out


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gamma-process arrival offsets: the first at 0, then gaps of mean ``1/rate``."""
    if math.isinf(rate):
        return [0.0] * n
    scale = 1.0 / (rate * burstiness)
    times, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, scale)
        times.append(t)
    return times


def draw_length(spec: GeneratorSpec, mean: int, cap: int, rng: random.Random) -> int:
    if spec.lengths == "fixed":
        return min(mean, cap)
    if spec.lengths == "uniform":
        low = max(1, round(mean * (1 - spec.range_ratio)))
        high = max(low, round(mean * (1 + spec.range_ratio)))
        return min(rng.randint(low, high), cap)
    # Log-normal with the requested mean: mu = ln(mean) - sigma^2 / 2.
    mu = math.log(mean) - spec.sigma**2 / 2
    return max(1, min(round(rng.lognormvariate(mu, spec.sigma)), cap))


def draw_pair(spec: GeneratorSpec, in_mean: int, out_mean: int, rng: random.Random) -> tuple[int, int]:
    """One request's (prompt, output) lengths: a pair of a measured table, or two synthetic draws.

    A table's lengths are capped only by a ``max_input`` / ``max_output`` given in the spec.
    """
    if spec.lengths in TABLES:
        n_in, n_out = rng.choice(length_table(spec.lengths))
        given = spec.model_fields_set
        return (min(n_in, spec.max_input) if "max_input" in given else n_in,
                min(n_out, spec.max_output) if "max_output" in given else n_out)  # fmt: skip
    return draw_length(spec, in_mean, spec.max_input, rng), draw_length(spec, out_mean, spec.max_output, rng)


def generate(spec_text: str, vocab_size: int, special_ids: Seq[int] = ()) -> Workload:
    """Draw a workload; the same spec and vocabulary always give the same requests."""
    _, spec = parse_spec(spec_text)
    if spec.lengths in TABLES and (shaped := {"input_len", "output_len", "range_ratio", "sigma"} & spec.model_fields_set):
        raise WorkloadError(f"workload {spec_text!r}: {', '.join(sorted(shaped))}: lengths={spec.lengths} draws "
                            "measured (prompt, output) pairs; the synthetic shape keys do not apply")  # fmt: skip
    special = set(special_ids)
    if vocab_size - len(special & set(range(vocab_size))) < 1:
        raise WorkloadError(f"workload {spec_text!r}: the vocabulary has no ordinary tokens to draw from")
    # Independent streams, so changing e.g. the rate does not change the prompts.
    rng_arrival = random.Random(f"{spec.seed}-arrival")
    rng_len = random.Random(f"{spec.seed}-lengths")
    rng_tok = random.Random(f"{spec.seed}-tokens")
    rng_who = random.Random(f"{spec.seed}-clients")
    rng_sys = random.Random(f"{spec.seed}-system")
    rng_deadline = random.Random(f"{spec.seed}-deadlines")

    def draw_tokens(n: int, rng: random.Random) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            tok = rng.randrange(vocab_size)
            if tok not in special:
                ids.append(tok)
        return ids

    times = arrival_times(spec.n, spec.rate, spec.burstiness, rng_arrival)
    in_mean, out_mean = spec.means
    clients = list(spec.clients)
    systems = [draw_tokens(spec.system_len, rng_sys) for _ in range(spec.system_prompts)]
    requests = []
    for i, t in enumerate(times):
        client, priority, deadline = spec.draw_class(rng_who, rng_deadline)
        previous = None
        for turn in range(spec.turns):
            n_in, n_out = draw_pair(spec, in_mean, out_mean, rng_len)
            ids = draw_tokens(n_in, rng_tok)
            if turn == 0 and spec.system_len:
                ids = systems[clients.index(client) % spec.system_prompts] + ids
            request_id = f"r{i}" if turn == 0 else f"r{i}.{turn}"
            requests.append(
                BenchRequest(
                    request_id=request_id,
                    arrival_s=t if turn == 0 else spec.think_s,
                    max_new_tokens=n_out,
                    prompt_token_ids=tuple(ids),
                    client_id=client,
                    priority=priority,
                    ignore_eos=spec.ignore_eos,
                    follows=previous,
                    deadline_s=deadline,
                )
            )
            previous = request_id
    return Workload(spec_text, tuple(requests))
