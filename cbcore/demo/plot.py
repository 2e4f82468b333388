"""The slot timeline of the demo runs, drawn with matplotlib: who held which slot at which step."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cbcore.demo.run import DemoRun


def _segments(timeline: list[list[str | None]], slot: int) -> list[tuple[str, int, int]]:
    """``(label, first step, number of steps)`` runs of one slot (steps count from 1)."""
    out: list[tuple[str, int, int]] = []
    for step, row in enumerate(timeline, start=1):
        label = row[slot] if slot < len(row) else None
        if label is None:
            continue
        if out and out[-1][0] == label and out[-1][1] + out[-1][2] == step:
            out[-1] = (label, out[-1][1], out[-1][2] + 1)
        else:
            out.append((label, step, 1))
    return out


def plot_timelines(runs: list[DemoRun], path: str | Path, prompts: dict[str, str] | None = None) -> Path:
    """One panel per run, sharing the step axis, so the shorter schedule is visible at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    labels = sorted({label for run in runs for row in run.tracker.timeline for label in row if label})
    colors = {label: plt.get_cmap("tab10")(i % 10) for i, label in enumerate(labels)}
    num_slots = max(len(row) for run in runs for row in run.tracker.timeline)
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.3 + 1.1 * num_slots * len(runs)), sharex=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, run in zip(axes, runs, strict=True):
        for slot in range(num_slots):
            for label, start, length in _segments(run.tracker.timeline, slot):
                ax.broken_barh([(start - 0.5, length)], (slot - 0.4, 0.8), color=colors[label])
                if length >= 4:
                    ax.text(start - 0.5 + length / 2, slot, label, ha="center", va="center", fontsize=9)
        idle = run.tracker.idle_while_waiting
        ax.set_title(
            f"{run.kind}: {run.steps} steps, {run.wall_s:.1f} s, "
            f"{idle} slot-steps idle while requests waited",
            fontsize=10,
            loc="left",
        )
        ax.set_yticks(range(num_slots), [f"slot {s}" for s in range(num_slots)])
        ax.set_ylim(num_slots - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("engine step")
    handles = [
        matplotlib.patches.Patch(
            color=colors[label], label=f"{label}: {(prompts or {}).get(label, label)[:40]}"
        )
        for label in labels
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
