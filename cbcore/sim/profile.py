"""The profile file: a step-time model and the identity of what it describes.

A profile is JSON (``cb profile --out`` writes one; roofline profiles are
written by hand or shipped under ``cbcore/sim/profiles``), or the name of a
measured GPU profile built from the shipped operator tables
(``a100-llama-2-7b-tp1``, :mod:`cbcore.sim.gpu`). It says which hardware,
model, dtype, backend and thread count it stands for, so a simulation states
what it simulated, and a measured profile carries its fit error or the
assumptions it rests on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from cbcore.cli.config_files import format_validation_error
from cbcore.sim.fitted import FittedCost
from cbcore.sim.gpu.catalog import GPUS, MODELS, CatalogError, Spec, parse, summary
from cbcore.sim.gpu.cost import MeasuredCost, StepPricer
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.roofline import RooflineCost
from cbcore.sim.shape import StepShape

BUILTIN_DIR = Path(__file__).parent / "profiles"
# Held-out step-time error (mean relative) above which a measured profile is refused. A quiet
# machine fits its held-out steps within 2-13 % (docs/simulate.md); one busy with other work
# times the same steps 40-150 % apart, and a simulation priced by that fit was 90 % off.
MAX_HOLDOUT_ERROR = 0.25


class ProfileError(ValueError):
    """A profile file is missing or malformed; the message names the file and the field."""


class Identity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hardware: str = Field(description="CPU model or accelerator name.")
    model: str
    dtype: Literal["float32", "float16", "bfloat16"]
    backend: str
    backend_variant: str | None = Field(
        None, description="The backend's code path while measured (sdpa: 'decode paged' or 'decode gather')."
    )
    threads: PositiveInt | None = Field(None, description="torch threads when measured; None for a roofline.")
    source: Literal["measured", "roofline"]
    created: str | None = None
    torch: str | None = None
    linear: Literal["onednn", "standard"] | None = Field(
        None,
        description="How the linear layers multiplied while measured (CPU): a real run with the other "
        "kind has other step times. None in profiles written before packed oneDNN linears.",
    )
    forward: Literal["fused", "hf"] | None = Field(
        None,
        description="Which code ran the model while measured (cbcore's fused forward or HF's modules). "
        "None in profiles written before the fused forward (they ran HF's modules).",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_field(cls, data: object) -> object:
        """Profiles written before packed oneDNN linears named per-row-count orders; their steps ran neither kind."""
        if isinstance(data, dict) and ({"linear_orders", "linear_transposed_rows"} & data.keys()):
            data = {k: v for k, v in data.items() if k not in ("linear_orders", "linear_transposed_rows")}
        return data


class Profile(BaseModel):
    """Everything the simulator needs to price a step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    identity: Identity
    model: ModelShape
    cost: Annotated[FittedCost | RooflineCost | MeasuredCost, Field(discriminator="kind")]

    @model_validator(mode="after")
    def _tables_fit_model(self) -> Profile:
        """Tables price the model they were measured with; only its context length may differ."""
        if isinstance(self.cost, MeasuredCost):
            want = MODELS[self.cost.spec.model].shape
            keep = {"name", "max_position_embeddings"}
            if self.model.model_dump(exclude=keep) != want.model_dump(exclude=keep):
                raise ValueError(f"model: the {self.cost.model} tables price {want.model_dump(exclude=keep)}")
        return self

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.identity.dtype == "float32" else 2

    def step_time(self, shape: StepShape, block_size: int) -> float:
        if isinstance(self.cost, FittedCost):
            return self.cost.step_time(shape)
        if isinstance(self.cost, MeasuredCost):
            return self.cost.step_time(shape, block_size)
        return self.cost.step_time(shape, self.model, self.dtype_bytes, block_size)

    def pricer(self, block_size: int) -> StepPricer | _Pricer:
        """``pricer(shape)`` -> seconds, with ``extrapolated``: the steps it priced beyond measured tables."""
        if isinstance(self.cost, MeasuredCost):
            return self.cost.pricer(block_size)
        return _Pricer(self, block_size)

    def kv_memory_mb(self) -> float | None:
        """Device memory for the KV pool that the profile itself states (roofline hardware), if any."""
        return self.cost.hardware.kv_memory_mb if isinstance(self.cost, RooflineCost) else None

    def kv_capacity_tokens(self) -> int | None:
        """Tokens of KV cache the profile's GPUs hold (measured GPU profiles), if it says."""
        return self.cost.kv_capacity_tokens() if isinstance(self.cost, MeasuredCost) else None

    def describe(self) -> dict[str, object]:
        data: dict[str, object] = self.identity.model_dump(exclude_none=True)
        if isinstance(self.cost, FittedCost):
            data["fit_mean_abs_error"] = self.cost.fit.mean_abs
            data["fit_holdout_mean_abs_error"] = self.cost.fit.holdout_mean_abs
        elif isinstance(self.cost, MeasuredCost):
            data.update(self.cost.describe())
        else:
            data["cost"] = "roofline from data-sheet numbers and the efficiencies in the file; not measured"
        return data

    def fit_error(self) -> float | None:
        """The held-out step-time error of a measured profile (the in-fit error if none was held out)."""
        if not isinstance(self.cost, FittedCost):
            return None
        fit = self.cost.fit
        return fit.holdout_mean_abs if fit.holdout_mean_abs is not None else fit.mean_abs

    def unreliable(self, name: str, retry: str) -> str | None:
        """Why this profile should not price a simulation (its fit is too poor), or None when it may.

        ``retry`` ends the message: what the caller's user can do instead (rerun, or ``--force``).
        """
        error = self.fit_error()
        if error is None or error <= MAX_HOLDOUT_ERROR:
            return None
        return (
            f"{name}: its held-out step-time error is {100 * error:.1f} %, above the "
            f"{100 * MAX_HOLDOUT_ERROR:.0f} % a simulation can be priced with: the machine was probably busy "
            f"while the steps were timed (other processes competing for its cores); {retry}"
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")


class _Pricer:
    """A profile's :meth:`Profile.step_time` as a pricer; fitted and roofline costs count no extrapolation."""

    __slots__ = ("block_size", "extrapolated", "profile")

    def __init__(self, profile: Profile, block_size: int) -> None:
        self.profile, self.block_size, self.extrapolated = profile, block_size, 0

    def __call__(self, shape: StepShape) -> float:
        return self.profile.step_time(shape, self.block_size)


def builtin_profiles() -> list[str]:
    """The roofline profiles shipped as files (kept where no measured table exists)."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def measured_profile(spec: Spec) -> Profile:
    """The profile of one measured GPU x model x TP degree."""
    gpu, model = GPUS[spec.gpu], MODELS[spec.model]
    network = f", {spec.network} all-reduce" if spec.tp > 1 else ""
    return Profile(
        identity=Identity(
            hardware=f"{gpu.name} x{spec.tp}{network}",
            model=model.shape.name,
            dtype="float16",
            backend="measured operators, attention roofline",
            source="measured",
        ),
        model=model.shape,
        cost=MeasuredCost(gpu=spec.gpu, model=spec.model, tp=spec.tp, network=spec.network, util=spec.util),
    )


def load_profile(spec: str | Path) -> Profile:
    """A path to a profile file, the name of a built-in roofline profile (``h200-llama-3-8b``), or of a
    measured GPU profile (``a100-llama-2-7b-tp1``, ``vidur:gpu=a100,model=llama-2-7b,tp=1``)."""
    path = Path(spec)
    if not path.exists() and (BUILTIN_DIR / f"{spec}.json").exists():
        path = BUILTIN_DIR / f"{spec}.json"
    if not path.exists():
        try:
            measured = parse(str(spec))
        except CatalogError as exc:
            raise ProfileError(f"profile {spec}: {exc}") from None
        if measured is not None:
            return measured_profile(measured)
    try:
        text = path.read_text()
    except OSError as exc:
        known = ", ".join(builtin_profiles())
        raise ProfileError(
            f"cannot read profile {spec}: {exc.strerror} (built-in roofline profiles: {known}; "
            f"measured GPU profiles: {', '.join(summary())})"
        ) from None
    try:
        return Profile.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except ValidationError as exc:
        raise ProfileError(f"profile {path}: {format_validation_error(exc)}") from None
