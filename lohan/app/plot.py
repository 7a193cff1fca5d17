"""The run's plot: loss (and eval loss), learning rate and tokens/s per step, drawn from its JSONL metrics file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lohan.app.layout import PLOT_RUN_KEY, PLOT_TAG
from lohan.app.metrics import load_metrics

__all__ = ["plot_metrics"]


def plot_metrics(metrics_path: str | Path, png_path: str | Path | None = None, run_id: str | None = None) -> Path | None:
    """Plot loss, learning rate and tokens/s per step of a JSONL metrics file next to it (``<stem>.png``); the
    eval loss of the records that have one is drawn next to the training loss, the steps that wrote a checkpoint
    are marked on the lr panel (the schedule).

    The PNG's text names lohan and `run_id` (the run the plot is of: `layout.plot_owner`, so that only that run
    replaces it; the caller checks that it may); it is written under a temporary name and renamed in.

    Returns the PNG path, or None when matplotlib is unavailable or there is nothing to plot.
    """
    records = [r for r in load_metrics(metrics_path) if isinstance(r.get("loss"), int | float)]
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    out = Path(png_path) if png_path else Path(metrics_path).with_suffix(".png")
    steps = [r["step"] for r in records]
    fig, (ax1, ax_lr, ax2) = plt.subplots(3, 1, figsize=(7, 7), sharex=True, height_ratios=(2, 1, 1.5))
    ax1.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    evals = [r for r in records if isinstance(r.get("eval_loss"), int | float)]
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], lw=1.5, marker="o", ms=3,
                 color="tab:orange", label="eval")
        ax1.legend(loc="upper right")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    _plot_lr(ax_lr, records)
    ax2.plot(steps, [r.get("tokens_per_s", float("nan")) for r in records], lw=1, color="tab:green")
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    fig.suptitle(Path(metrics_path).name)
    fig.tight_layout()
    # tagged: the run replaces this file, and only this one (layout.plot_owner)
    tmp = out.with_name(f".{out.name}.{run_id or os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100,
                    metadata={"Software": PLOT_TAG, **({PLOT_RUN_KEY: run_id} if run_id else {})})
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out


def _plot_lr(ax: Any, records: list[dict[str, Any]]) -> None:
    """The learning rate each step ran with (the schedule as it happened, a resume's changes included), and a
    mark at each step that wrote a checkpoint."""
    ax.plot([r["step"] for r in records], [r.get("lr", float("nan")) for r in records], lw=1, color="tab:purple")
    saved = [r for r in records if isinstance(r.get("save_s"), int | float)]
    if saved:
        ax.plot([r["step"] for r in saved], [r.get("lr", float("nan")) for r in saved], ls="none", marker="v",
                ms=4, color="tab:gray", label="checkpoint")
        ax.legend(loc="upper right")
    ax.set_ylabel("lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.grid(alpha=0.3)
