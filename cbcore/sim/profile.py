"""The profile file: a step-time model and the identity of what it describes.

A profile is JSON (``cb profile --out`` writes one; roofline profiles are
written by hand or shipped under ``cbcore/sim/profiles``). It says which
hardware, model, dtype, backend and thread count it stands for, so a
simulation states what it simulated, and a measured profile carries its fit
error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from cbcore.config import format_validation_error
from cbcore.sim.fitted import FittedCost
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
    cost: Annotated[FittedCost | RooflineCost, Field(discriminator="kind")]

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.identity.dtype == "float32" else 2

    def step_time(self, shape: StepShape, block_size: int) -> float:
        if isinstance(self.cost, FittedCost):
            return self.cost.step_time(shape)
        return self.cost.step_time(shape, self.model, self.dtype_bytes, block_size)

    def kv_memory_mb(self) -> float | None:
        """Device memory for the KV pool that the profile itself states (roofline hardware), if any."""
        return self.cost.hardware.kv_memory_mb if isinstance(self.cost, RooflineCost) else None

    def describe(self) -> dict[str, object]:
        data: dict[str, object] = self.identity.model_dump(exclude_none=True)
        if isinstance(self.cost, FittedCost):
            data["fit_mean_abs_error"] = self.cost.fit.mean_abs
            data["fit_holdout_mean_abs_error"] = self.cost.fit.holdout_mean_abs
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


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_profile(spec: str | Path) -> Profile:
    """A path to a profile file, or the name of a built-in profile (``h200-llama-3-8b``)."""
    path = Path(spec)
    if not path.exists() and (BUILTIN_DIR / f"{spec}.json").exists():
        path = BUILTIN_DIR / f"{spec}.json"
    try:
        text = path.read_text()
    except OSError as exc:
        known = ", ".join(builtin_profiles())
        raise ProfileError(
            f"cannot read profile {spec}: {exc.strerror} (built-in profiles: {known})"
        ) from None
    try:
        return Profile.model_validate(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except ValidationError as exc:
        raise ProfileError(f"profile {path}: {format_validation_error(exc)}") from None
