"""How far a measured profile's interpolation is from rows of its own table that it did not see.

For each profile, every fourth token count (never the first or last) is held
out, each operator's curve is rebuilt from the rest, and the held-out rows
are predicted: the relative error per operator, and for the whole layer (the
sum of the layer's operators, what a step pays per layer besides attention and
the all-reduce). The all-reduce curve gets the same treatment over message
sizes. Beside it, for comparison, the fitted roofline's error on the four
linear products of every row, computed as :mod:`cbcore.sim.anchor` computes
the shipped H100 roofline's 5.2 %; and the extrapolation rule's error when
the table is cut at half its token range and the rest is predicted from it.

    cb profile --check [NAME ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

import numpy as np

from cbcore.sim.gpu import catalog, tables
from cbcore.sim.model_shape import ModelShape
from cbcore.sim.roofline import Hardware, linear_time_per_layer

#: The roofline's (FLOP/s, bandwidth) efficiencies per GPU, fitted as ``cbcore.sim.anchor.fit_efficiencies``
#: fits them, on each GPU's Llama-2-7B TP 1 table (the H100's are the shipped roofline profiles').
ROOFLINE_EFFICIENCIES = {"a100": (0.78, 1.0), "a40": (0.88, 1.0), "h100": (0.88, 0.92)}
#: The bounds CI holds every measured profile to (tests/test_gpu_profiles.py): whole-layer
#: held-out error, mean and worst row.
LAYER_MEAN_BOUND = 0.025
LAYER_MAX_BOUND = 0.15
OP_LABELS = {"input_layernorm": "norm1", "attn_pre_proj": "qkv", "attn_rope": "rope", "attn_post_proj": "o",
             "post_attention_layernorm": "norm2", "mlp_up_proj": "up", "mlp_act": "act", "mlp_down_proj": "down",
             "add": "add", "emb": "emb"}  # fmt: skip


@dataclass
class CheckRow:
    """One profile's errors (relative, as fractions); None where the profile has no such part."""

    name: str
    rows: int
    held_out: int
    ops: dict[str, float]  # operator -> mean held-out error
    layer_mean: float
    layer_max: float
    linear_mean: float
    roofline_linear_mean: float
    allreduce_mean: float | None
    extrapolation_mean: float
    extrapolation_max: float


def _errors(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    return np.abs(pred - true) / true


def _held_out(curves: dict[str, tables.Curve], ops: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Predicted and measured sums of ``ops`` at the held-out token counts, and each operator's mean error."""
    x = np.array(curves[ops[0]].x)
    drop = tables.held_out(len(x))
    pred = np.zeros(len(drop))
    true = np.zeros(len(drop))
    per_op = {}
    for op in ops:
        curve = curves[op]
        p = curve.without(drop).over(x[drop])
        t = np.array(curve.y)[drop]
        per_op[op] = float(_errors(p, t).mean())
        pred += p
        true += t
    return pred, true, per_op


def _sharded(shape: ModelShape, tp: int) -> ModelShape:
    """The matrices one GPU multiplies at tensor-parallel degree ``tp``."""
    return shape.model_copy(
        update={
            "num_heads": shape.num_heads // tp,
            "num_kv_heads": -(-shape.num_kv_heads // tp),
            "intermediate_size": shape.intermediate_size // tp,
        }
    )


def roofline_hardware(gpu: str) -> Hardware:
    g = catalog.GPUS[gpu]
    flops, bandwidth = ROOFLINE_EFFICIENCIES[gpu]
    return Hardware(name=g.name, peak_flops=g.peak_flops, mem_bandwidth=g.mem_bandwidth,
                    flops_efficiency=flops, bandwidth_efficiency=bandwidth)  # fmt: skip


def check(spec: catalog.Spec) -> CheckRow:
    curves = tables.operator_curves(spec.gpu, spec.model, spec.tp)
    layer_ops = [op for op in tables.LAYER_OPS if op in curves]
    pred, true, per_op = _held_out(curves, layer_ops)
    _, _, emb = _held_out(curves, ["emb"])
    layer = _errors(pred, true)
    lin_pred, lin_true, _ = _held_out(curves, list(tables.LINEAR_OPS))
    x = np.array(curves["emb"].x)
    hw, shape = roofline_hardware(spec.gpu), _sharded(catalog.MODELS[spec.model].shape, spec.tp)
    measured = sum(np.array(curves[op].y) for op in tables.LINEAR_OPS)
    roofline = [
        abs(linear_time_per_layer(hw, shape, int(n), catalog.DTYPE_BYTES) - m) / m
        for n, m in zip(x, measured, strict=True)
    ]
    allreduce = None
    if spec.cluster is not None:
        ar = tables.allreduce_curve(spec.cluster, spec.tp)
        drop = tables.held_out(len(ar.x))
        allreduce = float(_errors(ar.without(drop).over(np.array(ar.x)[drop]), np.array(ar.y)[drop]).mean())
    half = x <= x[-1] / 2
    layer_all = sum(np.array(curves[op].y) for op in layer_ops)
    cut = tables.Curve(x[half], layer_all[half])
    extrapolated = _errors(cut.over(x[~half]), layer_all[~half])
    return CheckRow(
        name=spec.name,
        rows=len(x),
        held_out=len(tables.held_out(len(x))),
        ops={**per_op, **emb},
        layer_mean=float(layer.mean()),
        layer_max=float(layer.max()),
        linear_mean=float(_errors(lin_pred, lin_true).mean()),
        roofline_linear_mean=fmean(roofline),
        allreduce_mean=allreduce,
        extrapolation_mean=float(extrapolated.mean()),
        extrapolation_max=float(extrapolated.max()),
    )


def check_all(specs: list[catalog.Spec] | None = None) -> list[CheckRow]:
    return [check(s) for s in (specs if specs is not None else catalog.all_specs())]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def table(rows: list[CheckRow]) -> str:
    """The check as a markdown table (errors in %)."""
    ops = [op for op in OP_LABELS if any(op in r.ops for r in rows)]
    head = ["profile", "rows / held out", *(OP_LABELS[o] for o in ops), "**layer mean**", "layer max",
            "linear", "roofline linear (all rows)", "all-reduce", "extrapolated x2 mean / max"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [f"`{r.name}`", f"{r.rows} / {r.held_out}", *(_pct(r.ops.get(o)) for o in ops),
                 f"**{_pct(r.layer_mean)}**", _pct(r.layer_max), _pct(r.linear_mean), _pct(r.roofline_linear_mean),
                 _pct(r.allreduce_mean), f"{_pct(r.extrapolation_mean)} / {_pct(r.extrapolation_max)}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[CheckRow]) -> str:
    """One paragraph: the means over profiles, the worst profile, the bounds."""
    worst = max(rows, key=lambda r: r.layer_mean)
    return (
        f"{len(rows)} profiles; whole-layer held-out error: mean over profiles "
        f"{_pct(fmean(r.layer_mean for r in rows))} %, worst profile {worst.name} {_pct(worst.layer_mean)} % "
        f"(worst row of any profile {_pct(max(r.layer_max for r in rows))} %); the four linear products "
        f"{_pct(fmean(r.linear_mean for r in rows))} % held out against the fitted roofline's "
        f"{_pct(fmean(r.roofline_linear_mean for r in rows))} % (all rows). CI bounds: mean "
        f"{_pct(LAYER_MEAN_BOUND)} %, worst row {_pct(LAYER_MAX_BOUND)} % per profile."
    )
