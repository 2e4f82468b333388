"""The ``cbcore`` section of vLLM's ``--additional-config``: which plugins decide, and with what.

It is the ``plugins:`` and ``scheduler:`` sections of a cbcore config file,
validated by cbcore itself (each plugin's own ``Params`` model, key paths and
"did you mean" suggestions), plus what only the adapter needs: the clock the
policies read, and the vLLM version it accepts. Everything else in a cbcore
config (``kv_cache``, ``backend``, ``model``) belongs to vLLM's own flags, so
naming it here is an error rather than something silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cbcore_vllm._cbcore import ConfigError, EngineConfig, PluginError, format_validation_error

KEY = "cbcore"  # additional_config["cbcore"]
# The vLLM releases the adapter is tested on (docs/vllm.md, "Versions"); shim.py has a section for each.
TESTED_VLLM = ("0.32.0", "0.33.0", "0.34.0")

# cbcore config sections that vLLM's own flags decide; each with the flag to use instead.
_VLLM_OWNS = {
    "kv_cache": "--block-size, --num-gpu-blocks-override, VLLM_CPU_KVCACHE_SPACE, --enable-prefix-caching",
    "backend": "vLLM's attention backend",
    "model": "--model, --dtype, --max-model-len",
    "execution": "vLLM's model runner",
    "serve": "vLLM's API server flags",
    "router": "a router above several vLLM servers",
}


class StepClock(BaseModel):
    """A virtual clock for policies: ``step_s`` seconds per scheduler step.

    Time-dependent policies (aging, deadlines) then decide the same way on
    every run of a trace, in vLLM and in cbcore's engine given the same
    clock; the wall clock (the default) is what a deployment wants.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal["step"] = "step"
    step_s: float = Field(gt=0, description="Seconds the policy clock advances per schedule() call.")


class AdapterConfig(BaseModel):
    """What the adapter reads besides cbcore's own sections."""

    model_config = ConfigDict(extra="forbid", strict=True)

    clock: Literal["wall"] | StepClock = "wall"
    allow_untested_vllm: bool = Field(
        False,
        description=f"Start on a vLLM other than {', '.join(TESTED_VLLM)}, whose scheduler the adapter was not "
        "tested on (with the internals of the nearest older tested version).",
    )


def parse(additional_config: Any) -> tuple[EngineConfig, AdapterConfig]:
    """The cbcore and adapter configs from vLLM's ``additional_config``; ConfigError naming the key otherwise."""
    if not isinstance(additional_config, dict) or KEY not in additional_config:
        raise ConfigError(
            f"cbcore_vllm.Scheduler needs --additional-config '{{\"{KEY}\": {{\"scheduler\": {{...}}}}}}' "
            "(the plugins: and scheduler: sections of a cbcore config)"
        )
    section = additional_config[KEY]
    if not isinstance(section, dict):
        raise ConfigError(f"additional_config.{KEY} must be a mapping, got {type(section).__name__}")
    for key, instead in _VLLM_OWNS.items():
        if key in section:
            raise ConfigError(f"additional_config.{KEY}.{key}: inside vLLM this is decided by {instead}")
    own = {k: section[k] for k in ("clock", "allow_untested_vllm") if k in section}
    cbcore_part = {k: v for k, v in section.items() if k not in own}
    try:
        adapter = AdapterConfig.model_validate(own)
    except ValidationError as exc:
        raise ConfigError(f"additional_config.{KEY}: {format_validation_error(exc)}") from None
    try:
        config = EngineConfig.model_validate(cbcore_part)
    except ValidationError as exc:
        raise ConfigError(f"additional_config.{KEY}: {format_validation_error(exc)}") from None
    except PluginError as exc:
        raise ConfigError(f"additional_config.{KEY}: {exc}") from None
    if config.scheduler.name is not None:
        raise ConfigError(
            f"additional_config.{KEY}.scheduler.name: {config.scheduler.name!r} replaces cbcore's whole scheduler; "
            "inside vLLM only the four policy slots (queue, budget, prefill, preemption) can decide"
        )
    return config, adapter
