"""What the decision check runs: the config, the workload as driver requests, and one geometry for both engines."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbcore_vllm._cbcore import (
    ConfigError,
    EngineConfig,
    PluginError,
    WorkloadError,
    format_validation_error,
    get_registry,
    load_workload,
    read_config_file,
)
from cbcore_vllm.check.model import tiny_llama

SECTIONS = ("plugins", "scheduler", "kv_cache")  # what of a cbcore config the check reads
DEFAULT_BLOCKS = 256


class CheckError(ValueError):
    """The check cannot run as asked; the message says what to change."""


@dataclass
class Setup:
    config: dict[str, Any]  # plugins and scheduler, as read
    block_size: int
    num_blocks: int
    prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    step_s: float
    vllm: str  # "engine" or "scheduler"
    model: str | None
    requests: list[dict[str, Any]]
    workload: str

    def model_dir(self, tmp: Path) -> Path:
        return Path(self.model) if self.model else tiny_llama(tmp / "tiny-llama")

    def cbcore_config(self) -> dict[str, Any]:
        kv = {"block_size": self.block_size, "num_blocks": self.num_blocks, "prefix_caching": self.prefix_caching}
        return {**self.config, "kv_cache": kv}

    def adapter_config(self) -> dict[str, Any]:
        return {**self.config, "clock": {"step_s": self.step_s}}

    def engine_args(self) -> dict[str, Any]:
        return {
            "skip_tokenizer_init": True,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_gpu_blocks_override": self.num_blocks + 1,  # vLLM keeps one null block
            "block_size": self.block_size,
            "enable_prefix_caching": self.prefix_caching,
        }

    def describe(self, version: str) -> str:
        what = "offline engine" if self.vllm == "engine" else "scheduler alone, fake model outputs"
        return (
            f"workload {self.workload}: {len(self.requests)} requests; vLLM {version} ({what}), synchronous; "
            f"{self.num_blocks} KV blocks of {self.block_size}, {self.max_num_seqs} sequences / "
            f"{self.max_num_batched_tokens} tokens a step, prefix caching {'on' if self.prefix_caching else 'off'}, "
            f"step clock {self.step_s} s"
        )


def _limit(params: Any, name: str, given: int | None) -> int:
    if given is not None:
        return given
    value = getattr(params, name, None)
    if not isinstance(value, int):
        raise CheckError(f"the budget policy has no {name} parameter: give vLLM's with --{name.replace('_', '-')}")
    return value


def _requests(spec: str, model: str | None, step_s: float) -> list[dict[str, Any]]:
    from transformers import AutoConfig

    from cbcore_vllm.check.model import _config

    hf = AutoConfig.from_pretrained(model) if model else _config()
    special = [i for i in (hf.bos_token_id, hf.eos_token_id, getattr(hf, "pad_token_id", None)) if isinstance(i, int)]
    try:
        workload = load_workload(spec, hf.vocab_size, special)
    except WorkloadError as exc:
        raise CheckError(str(exc)) from None
    tokenizer = None
    if any(r.prompt_token_ids is None for r in workload.requests):
        if model is None:
            raise CheckError("the workload has text prompts: give --model with a tokenizer, or token ids")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for r in workload.requests:
        if r.follows is not None:
            raise CheckError(f"request {r.request_id} follows another: the check replays open-loop workloads only")
        xargs: dict[str, Any] = {"client_id": r.client_id}
        if r.deadline_s is not None:
            xargs["deadline_s"] = r.deadline_s
        if r.attrs:
            xargs["attrs"] = {k: v for k, v in r.to_json().get("attrs", {}).items()}
        out.append({
            "id": r.request_id, "prompt": r.token_ids(tokenizer), "max_tokens": r.max_new_tokens,
            "priority": r.priority, "xargs": xargs, "arrive": math.ceil(r.arrival_s / step_s - 1e-9),
        })  # fmt: skip
    return out


def prepare(args: Any) -> Setup:
    """The run the command line asks for; CheckError naming what is wrong."""
    try:
        data = read_config_file(args.config)
        extra = sorted(set(data) - set(SECTIONS))
        if extra:
            raise CheckError(f"{args.config}: the check reads only {', '.join(SECTIONS)}; remove {', '.join(extra)}")
        config = EngineConfig.model_validate(data)
        registry = get_registry(tuple(config.plugins))
        budget = config.scheduler.budget
        params = registry.params_for("budget", budget.name, budget.params, "scheduler.budget")
    except (ConfigError, PluginError) as exc:
        raise CheckError(str(exc)) from None
    except ValueError as exc:  # pydantic's
        raise CheckError(f"{args.config}: {format_validation_error(exc) if hasattr(exc, 'errors') else exc}") from None
    kv = config.kv_cache
    requests = _requests(args.workload, args.model, args.step_s)
    block = kv.block_size if "block_size" in data.get("kv_cache", {}) else 32
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    return Setup(
        config={k: data[k] for k in ("plugins", "scheduler") if k in data},
        block_size=block,
        num_blocks=kv.num_blocks or DEFAULT_BLOCKS,
        prefix_caching=kv.prefix_caching and args.vllm == "engine",
        max_num_seqs=_limit(params, "max_num_seqs", args.max_num_seqs),
        max_num_batched_tokens=_limit(params, "max_num_batched_tokens", args.max_num_batched_tokens),
        max_model_len=args.max_model_len or -(-longest // block) * block,
        step_s=args.step_s,
        vllm=args.vllm,
        model=args.model,
        requests=requests,
        workload=args.workload,
    )
