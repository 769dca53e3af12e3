"""python -m ray_jobs.plot: the figure's panels, axes and line data against metrics.jsonl (not pixels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from ray_jobs import plot

ROOT = Path(__file__).resolve().parents[1]
RUN_COLOURS = ["#1f77b4", "#ff7f0e"]  # matplotlib's default cycle, C0 and C1: run-a blue, run-b orange


def write_run(run_dir: Path, steps: list[int], world: dict[int, int], val_every: int = 0, scale: float = 1.0,
              torn_tail: bool = False) -> list[dict]:
    """A metrics.jsonl as worker.report writes it (plus fields the plot ignores)."""
    records = []
    for s in steps:
        rec = {"optimizer_step": s, "loss": scale * 8.0 / (1 + s), "lr": 1e-3 * min(1.0, s / 20), "grad_norm": 1.0 + 1 / s,
               "tokens_per_s": 4000.0 + 10 * s, "world_size": world[s], "epoch": 0, "time": 1.7e9 + s,
               "run_id": run_dir.name, "expert_load": [[0.5, 0.5]]}
        if val_every and s % val_every == 0:
            rec["val_loss"] = scale * 9.0 / (1 + s)
            rec["val_bpb"] = scale * 3.0 / (1 + s)
        records.append(rec)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text + ('{"optimizer_step": 9' if torn_tail else ""))
    return records


@pytest.fixture
def two_runs(tmp_path):
    a = tmp_path / "storage" / "run-a"
    b = tmp_path / "storage" / "run-b"
    steps_a = list(range(10, 101, 10))
    rec_a = write_run(a, steps_a, {s: 2 if s <= 50 else 4 for s in steps_a}, val_every=50, torn_tail=True)
    steps_b = list(range(5, 61, 5))
    rec_b = write_run(b, steps_b, {s: 1 for s in steps_b}, scale=1.1)
    return (a, rec_a), (b, rec_b)


def test_panels_axes_and_line_data_match_metrics_jsonl(two_runs):
    (a, rec_a), (b, rec_b) = two_runs
    fig = plot.figure_for_runs(plot.load_runs([a, b]))
    axes = fig.axes
    titles = [ax.get_title() for ax in axes[:5]]
    assert titles == ["loss", "learning rate", "grad norm (before clipping)", "throughput", "world size"]
    assert [ax.get_xlabel() for ax in axes[:5]] == ["optimizer step"] * 5
    assert [ax.get_ylabel() for ax in axes[:5]] == ["loss", "lr", "grad_norm", "tokens/s", "workers"]
    for ax, metric in zip(axes[:5], ["loss", "lr", "grad_norm", "tokens_per_s", "world_size"], strict=True):
        for i, records in enumerate((rec_a, rec_b)):
            line = ax.lines[i]
            expected = [[r["optimizer_step"], r[metric]] for r in records]
            assert line.get_xydata().tolist() == expected, (metric, i)  # the values themselves, as float64
            assert line.get_label() == ("run-a", "run-b")[i]
            assert to_hex(line.get_color()) == RUN_COLOURS[i]  # run i has one colour on every panel
    # val_loss: dashed, only where it was evaluated, only for the run that has it.
    val = [line for line in axes[0].lines if line.get_label().endswith("val_loss")]
    assert [line.get_label() for line in val] == ["run-a val_loss"]
    assert val[0].get_linestyle() == "--" and to_hex(val[0].get_color()) == RUN_COLOURS[0]
    assert val[0].get_xydata().tolist() == [[50, rec_a[4]["val_loss"]], [100, rec_a[9]["val_loss"]]]
    assert axes[4].lines[0].get_drawstyle() == "steps-post"  # world size 2 -> 4 is a step, not a ramp
    assert axes[5].get_title() == "held-out bits per byte" and [line.get_label() for line in axes[5].lines] == ["run-a"]
    assert axes[5].lines[0].get_xydata().tolist() == [[50, rec_a[4]["val_bpb"]], [100, rec_a[9]["val_bpb"]]]
    legend = axes[6].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["run-a", "run-b", "run-a val_loss"]


def test_same_run_name_in_two_storage_paths_gets_told_apart(tmp_path):
    write_run(tmp_path / "s1" / "run", [1, 2], {1: 1, 2: 1})
    write_run(tmp_path / "s2" / "run", [1, 2], {1: 1, 2: 1})
    assert [r.label for r in plot.load_runs([tmp_path / "s1" / "run", tmp_path / "s2" / "run"])] == ["s1/run", "s2/run"]


def test_a_repeated_step_never_doubles_back(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [{"optimizer_step": s, "loss": v} for s, v in [(1, 3.0), (2, 2.0), (3, 1.5), (2, 2.2), (3, 1.4), (4, 1.0)]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig = plot.figure_for_runs(plot.load_runs([run]))
    assert fig.axes[0].lines[0].get_xydata().tolist() == [[1, 3.0], [2, 2.2], [3, 1.4], [4, 1.0]]
    assert len(fig.axes[1].lines) == 0  # no lr in these records: no line, no error


def test_cli_writes_a_png_per_default_and_to_out(two_runs, tmp_path, capsys):
    (a, _), (b, _) = two_runs
    assert plot.main(["--run-dir", str(a)]) == 0
    assert (a / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "figs" / "cmp.png"
    assert plot.main(["--run-dir", str(a), str(b), "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.splitlines() == [f"wrote {a / 'metrics.png'}", f"wrote {out}"]


def test_module_entry_point(tmp_path):
    """`python -m ray_jobs.plot` as a user runs it: a bad folder is one line and exit 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.plot", "--run-dir", str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path / 'nope'}: no such run folder\n"
    assert proc.stdout == ""


def test_scores_beside_training_are_not_training_steps():
    from ray_jobs.plot import in_step_order

    train = {"optimizer_step": 4, "loss": 2.0}
    score = {"optimizer_step": 4, "eval_task": "cloze", "eval/cloze/acc": 0.5}  # written after step 8's record
    assert in_step_order([train, {"optimizer_step": 8, "loss": 1.5}, score]) == [train, {"optimizer_step": 8,
                                                                                        "loss": 1.5}]
