"""Engine configuration: the pydantic models of what the engine reads.

Each policy slot and the backend are ``{name: ..., <params>}`` mappings; the
params are validated against the plugin's own ``Params`` model when the config
is validated, so a typo fails before any model is loaded and the error names
the key path. Files and ``--set`` overrides are read into plain data by
:mod:`cbcore.cli.config_files` (:meth:`EngineConfig.from_file`, ``from_dict``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, StrictBool, ValidationInfo, model_validator

from cbcore.cli.config_files import ConfigError as ConfigError  # raised by from_file / from_dict
from cbcore.cli.config_files import apply_overrides, read_config_file, suggests_keys
from cbcore.plugins import SLOTS, get_registry

CACHE_ENV = "CBCORE_CACHE_DIR"


def cache_root() -> Path:
    """Where cbcore keeps what it computes once per machine (the converted default model,
    compiled kernels): ``$CBCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cbcore``, else ``~/.cache/cbcore``."""
    if explicit := os.environ.get(CACHE_ENV):
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "cbcore"


class PluginSpec(BaseModel):
    """``{name: <registered name or module:Class>, **params}``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Strict(BaseModel):
    """Unknown keys fail, values are not coerced ("5" is not 5), numbers are finite, and a config never
    changes once made."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


@suggests_keys
class SchedulerConfig(Strict):
    """One policy per extension point and the phase order, or ``name`` naming a whole-scheduler replacement."""

    queue: PluginSpec = PluginSpec(name="fcfs")
    budget: PluginSpec = PluginSpec(name="token-budget")
    prefill: PluginSpec = PluginSpec(name="chunked-prefill")
    preemption: PluginSpec = PluginSpec(name="recompute")
    # decode-first: running sequences, then swapped ones, then admissions (Sarathi's stall-free order);
    # prefill-first: admissions first, then running prefills before decodes, then swapped ones.
    order: Literal["decode-first", "prefill-first"] = "decode-first"
    # A registered `scheduler`-kind plugin that replaces the composed scheduler.
    name: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _default_slot_names(cls, data: Any) -> Any:
        """A slot given only parameters (``--set scheduler.prefill.chunk_size=32``) keeps its default policy."""
        if not isinstance(data, dict):
            return data
        if isinstance(prefill := data.get("prefill"), dict) and "order" in prefill:
            raise ValueError("scheduler.prefill.order is now scheduler.order (the phase order is the scheduler's)")
        given = {slot: v for slot in SLOTS if isinstance(v := data.get(slot), dict)}
        return data | {slot: {"name": cls.model_fields[slot].default.name} | v for slot, v in given.items()}


#: Sizes past any device (a pebibyte of KV, 2**31 blocks): larger ones overflow when the pool is allocated,
#: after the model has loaded, so they are refused with the config.
MAX_KV_MEMORY_MB = float(2**30)
MAX_BLOCKS = 2**31


@suggests_keys
class KVCacheConfig(Strict):
    block_size: int = Field(16, gt=0, le=2**16)
    num_blocks: int | None = Field(None, gt=0, le=MAX_BLOCKS)  # None: as many as max_memory_mb holds
    # the device KV pool's budget when num_blocks is None
    max_memory_mb: float = Field(1024.0, gt=0, le=MAX_KV_MEMORY_MB)
    # host blocks for swap preemption; None: as many as the device pool
    num_host_blocks: int | None = Field(None, ge=0, le=MAX_BLOCKS)
    # Reuse the KV of full blocks whose prefix another request already computed; freed cached blocks stay
    # findable until their space is needed.
    prefix_caching: StrictBool = True


@suggests_keys
class ModelConfig(Strict):
    path: str | None = None  # HF model directory or hub id; None: the embedded default
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    max_model_len: PositiveInt | None = None  # None: the model's max_position_embeddings
    trust_remote_code: bool = False


class ExecutionConfig(Strict):
    """How the runner drives the model's kernels (numbers stay the same, speed changes).

    ``forward``: which code runs the model in engine steps: ``fused`` (cbcore's own forward for the
    Llama family: Llama, Mistral, Qwen2), ``hf`` (transformers' modules, any supported model), or
    ``auto``: fused where the model is of its family, else hf. ``linear``: how the fused forward's
    linear layers multiply: ``onednn`` (weights packed once for oneDNN; CPU float32, bfloat16 where
    the CPU has bf16; as much memory again as the linear weights; a float32 product of more than 256
    rows, a prefill, goes to ``F.linear`` or to oneDNN in pieces, whichever ran faster when timed once
    on this machine, ``$CBCORE_PREFILL_PRODUCTS`` forcing one), ``standard`` (``F.linear``), or
    ``auto``: onednn where it can run, else standard. HF's modules multiply with ``F.linear``.
    """

    forward: Literal["auto", "fused", "hf"] = "auto"
    linear: Literal["auto", "onednn", "standard"] = "auto"


#: Sections of a config file that the applications read and the engine does not, each with who reads
#: it. One file holds both: the ``cb`` commands load it as ``cbcore.serve.config.Settings``.
APPLICATION_SECTIONS = {
    "serve": "`cb serve`'s section",
    "router": "the replicas' router (`cb serve --replicas`, `cb simulate --replicas`)",
}


@suggests_keys
class EngineConfig(Strict):
    """What the engine reads. A config file may hold more (:data:`APPLICATION_SECTIONS`): such a file is
    the applications', loaded whole by ``cbcore.serve.config.Settings``, a subclass of this one."""

    # Strict everywhere, plugin params too (see plugins.py): "5" is not 5, "yes" is not True.
    scheduler: SchedulerConfig = SchedulerConfig()
    backend: PluginSpec = PluginSpec(name="sdpa")
    kv_cache: KVCacheConfig = KVCacheConfig()
    model: ModelConfig = ModelConfig()
    execution: ExecutionConfig = ExecutionConfig()
    plugins: list[str] = Field(default_factory=list)  # modules or .py files that implement cbcore hooks

    @model_validator(mode="before")
    @classmethod
    def _finite_numbers(cls, data: Any) -> Any:
        """Every number finite, plugin parameters included (their models are the plugins' own): an ``inf``
        or ``nan`` would pass a ``> 0`` check and fail later, once the model has loaded."""
        if (found := _non_finite(data)) is not None:
            where, value = found
            raise ValueError(f"{where}: {value!r} is not a finite number")
        return data

    @model_validator(mode="before")
    @classmethod
    def _engine_sections_only(cls, data: Any) -> Any:
        """An application's section is named, with the model that reads it, instead of being dropped or
        refused as an unknown key."""
        if isinstance(data, dict) and (found := sorted(APPLICATION_SECTIONS.keys() & data.keys() - cls.model_fields)):
            named = "; ".join(f"{key}: {APPLICATION_SECTIONS[key]}, which the engine does not read" for key in found)
            raise ValueError(f"{named}; load the whole file with cbcore.serve.config.Settings (the cb commands do)")
        return data

    @model_validator(mode="after")
    def _check_plugins(self, info: ValidationInfo) -> Self:
        registry = get_registry(tuple(self.plugins))
        if self.scheduler.name is not None:
            registry.params_for("scheduler", self.scheduler.name, self.scheduler.params, "scheduler")
        for slot in SLOTS:
            spec: PluginSpec = getattr(self.scheduler, slot)
            registry.params_for(slot, spec.name, spec.params, f"scheduler.{slot}")
        if (info.context or {}).get("backend", True):  # a simulated engine has none: it runs no model (nor torch)
            registry.params_for("backend", self.backend.name, self.backend.params, "backend")
        return self

    # -- loading -------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] | None = None) -> Self:
        return cls.from_dict(read_config_file(path), overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any], overrides: list[str] | None = None, backend: bool = True) -> Self:
        return cls.model_validate(apply_overrides(data, overrides or []), context={"backend": backend})


def _non_finite(data: Any) -> tuple[str, float] | None:
    """The key path and value of the first infinite or NaN float in plain data, else None (no recursion)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return where or "config", value
        if isinstance(value, dict):
            stack.extend((f"{where}.{key}" if where else str(key), item) for key, item in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None
