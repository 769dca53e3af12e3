"""Plot training curves from metrics.jsonl, for runs without an experiment tracker.

    python -m ray_jobs.plot --run-dir runs/run1                             # -> runs/run1/metrics.png
    python -m ray_jobs.plot --run-dir runs/run1 runs/run2 --output cmp.png  # several runs, one colour each

One panel per metric against the optimizer step (val_loss dashed on the loss panel); `ray_jobs.tune`
draws its loss_curves.png with the same figure. Needs only matplotlib: neither Ray nor torch is imported.
The flags every command shares: minilm.cli (`RUN_DIR...` and `--out` are the old spellings of `--run-dir`
and `--output`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from minilm.cli import ArgumentParser, command, fail, note
from minilm.fsio import read_jsonl

# (metric, panel title, y-axis label); world size is a step function.
PANELS = (
    ("loss", "loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("grad_norm", "grad norm (before clipping)", "grad_norm"),
    ("tokens_per_s", "throughput", "tokens/s"),
    ("world_size", "world size", "workers"),
    ("val_bpb", "held-out bits per byte", "val_bpb"),
)


class PlotError(Exception):
    """A run folder or its metrics.jsonl cannot be plotted; the message names it."""


@dataclass
class RunCurves:
    label: str
    records: list[dict]  # one per reported optimizer step, in step order

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that have `metric`."""
        points = [(r["optimizer_step"], float(r[metric])) for r in self.records
                  if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)]
        return [s for s, _ in points], [v for _, v in points]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, one per optimizer step, in step order; a torn line is skipped."""
    run = Path(run_dir)
    if not run.is_dir():
        raise PlotError(f"{run_dir}: no such run folder")
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: not found (is {run_dir} a run folder of ray_jobs.pretrain with a local "
                        f"--run-dir?)")
    records = in_step_order(read_jsonl(path)[0])
    if not records:
        raise PlotError(f"{path}: no metrics records yet (the run reports every --log-every steps)")
    return records


def in_step_order(records: list) -> list[dict]:
    """One record per integer optimizer_step, in step order; of a step logged twice (a restored Tune
    trial) the later record wins, so a curve never doubles back. The scores of evaluations beside training
    (`eval_task` records) are not training steps."""
    by_step: dict[int, dict] = {}
    for rec in records:
        if isinstance(rec, dict) and isinstance(rec.get("optimizer_step"), int) \
                and not isinstance(rec["optimizer_step"], bool) and "eval_task" not in rec:
            by_step[rec["optimizer_step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def load_runs(run_dirs: list[str | Path]) -> list[RunCurves]:
    paths = [Path(d) for d in run_dirs]
    names = [p.resolve().name for p in paths]
    runs = []
    for path, name in zip(paths, names, strict=True):
        # Two runs of the same name (different storage paths) are told apart by their parent folder.
        label = f"{path.resolve().parent.name}/{name}" if names.count(name) > 1 else name
        runs.append(RunCurves(label, read_metrics(path)))
    return runs


def figure_for_runs(runs: list[RunCurves]) -> Figure:
    """One panel per metric of PANELS, plus a legend panel; run i is ax.lines[i] in colour Ci on every panel (then
    the loss panel's dashed val_loss lines)."""
    fig = Figure(figsize=(12, 13), layout="constrained")
    FigureCanvasAgg(fig)  # rendered with Agg: no display, no pyplot state
    axes = fig.subplots(4, 2, sharex=True).flatten()
    for ax, (metric, title, ylabel) in zip(axes, PANELS, strict=False):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("optimizer step")
        ax.tick_params(labelbottom=True)  # sharex hides inner tick labels; every panel keeps its step axis
        ax.grid(True, alpha=0.3)
        for i, run in enumerate(runs):
            steps, values = run.series(metric)
            if steps:
                ax.plot(steps, values, color=f"C{i % 10}", label=run.label,
                        drawstyle="steps-post" if metric == "world_size" else "default")
        if metric == "loss":
            for i, run in enumerate(runs):
                steps, values = run.series("val_loss")
                if steps:
                    ax.plot(steps, values, color=f"C{i % 10}", linestyle="--", marker="o", markersize=3,
                            label=f"{run.label} val_loss")
        if metric == "world_size":
            ax.yaxis.get_major_locator().set_params(integer=True)
    legend_ax = axes[len(PANELS)]
    legend_ax.axis("off")
    for spare in axes[len(PANELS) + 1:]:
        spare.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    legend_ax.legend(handles, labels, loc="center", title="runs (dashed: val_loss)", frameon=False)
    fig.suptitle("training curves from metrics.jsonl")
    return fig


def save_figure(runs: list[RunCurves], out: str | Path) -> Figure:
    """figure_for_runs(runs), written as a PNG to `out` (its folder created)."""
    fig = figure_for_runs(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m ray_jobs.plot", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--run-dir", nargs="+", action="extend", default=[], dest="run_dirs", metavar="DIR",
                   help="run folder(s) holding metrics.jsonl, one curve each (default: none)")
    p.add_argument("old_run_dirs", nargs="*", help=argparse.SUPPRESS)  # the old spelling: positional RUN_DIRs
    p.add_argument("--output", help="PNG to write (default: RUN_DIR/metrics.png for one run, ./metrics.png for "
                                    "several)")
    p.rename("--output", "--out")
    return p


@command(PlotError)
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.old_run_dirs:
        note("RUN_DIR... is now --run-dir RUN_DIR...")
    args.run_dirs += args.old_run_dirs
    if not args.run_dirs:
        parser.error("give --run-dir DIR (one or more)")
    default = Path(args.run_dirs[0]) / "metrics.png" if len(args.run_dirs) == 1 else Path("metrics.png")
    out = Path(args.output) if args.output else default
    if out.suffix.lower() != ".png":
        return fail(f"--output {out}: expected a .png file")
    try:
        save_figure(load_runs(args.run_dirs), out)
    except OSError as e:  # the PNG cannot be written there
        return fail(f"cannot write {out}: {e.strerror or e}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
