"""Ray Tune sweeps over the pretraining job: search specs, a small sweep end to end, resume, results."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from conftest import run_env
from helpers import make_prepared, run_module

from ray_jobs.cli import UsageError
from ray_jobs.tune import parse_search, search_space


@pytest.mark.parametrize("spec,kind,values", [
    ("lr=loguniform:1e-4:3e-3", "loguniform", (1e-4, 3e-3)),
    ("grad_clip=uniform:0.5:2", "uniform", (0.5, 2.0)),
    ("warmup_steps=choice:0,50,200", "choice", (0, 50, 200)),
    ("global-batch-size=choice:16,32", "choice", (16, 32)),
    ("min_lr_ratio=choice:0.1,0.0", "choice", (0.1, 0.0)),
    ("lr=grid:1e-4,1e-3", "grid", (1e-4, 1e-3)),
])
def test_parse_search(spec, kind, values):
    dim = parse_search(spec)
    assert dim.kind == kind and dim.values == values


@pytest.mark.parametrize("spec,message", [
    ("lr", "expected NAME=KIND:ARGS"),
    ("lr=loguniform:1e-3", "cannot parse"),
    ("lr=loguniform:abc:1", "cannot parse"),
    ("lr=gauss:1:2", "unknown kind 'gauss'"),
    ("depth=choice:1,2", "unknown parameter 'depth'"),
    ("lr=uniform:3e-3:1e-4", "low 0.003 must be < high 0.0001"),
    ("lr=loguniform:0:1e-3", "loguniform needs low > 0"),
    ("warmup_steps=uniform:0:10", "warmup_steps is an integer"),
    ("warmup_steps=choice:", "cannot parse"),
    ("warmup_steps=choice:1,1", "repeated value"),
])
def test_bad_search_specs_are_refused(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_search(spec)


def test_search_space_flags_win_over_yaml_and_empty_is_refused():
    dims = search_space(["lr=choice:1e-3"], {"lr": "loguniform:1e-4:1e-2", "grad_clip": "uniform:0.5:1"})
    assert dims["lr"].kind == "choice" and dims["grad_clip"].kind == "uniform"
    with pytest.raises(UsageError, match="nothing to search"):
        search_space([], None)


def test_loss_curves_are_ray_jobs_plot_s_figure_of_what_each_trial_reported(tmp_path):
    """Tune's results (a dataframe per trial: numpy numbers, NaN where val_loss was not evaluated, a step
    reported again after the trial was restored) become ray_jobs.plot's panels, one line per trial."""
    import numpy as np
    import pandas as pd

    from ray_jobs.plot import PANELS
    from ray_jobs.tune import SearchDim, plot_trials, reported_records

    nan = float("nan")
    a = pd.DataFrame({"optimizer_step": np.array([2, 4, 6, 4, 6, 8]), "loss": [5.0, 4.0, 3.5, 4.1, 3.4, 3.0],
                      "lr": [1e-4] * 6, "grad_norm": [2.0, 1.5, 1.2, 1.6, 1.1, 0.9],
                      "tokens_per_s": [900.0, 1000.0, 1100.0, 950.0, 1050.0, 1200.0], "world_size": [1] * 6,
                      "val_loss": [nan, 4.5, nan, 4.4, nan, 3.9], "trial_id": ["a1"] * 6})
    b = pd.DataFrame({"optimizer_step": [2, 4], "loss": [5.5, 9.0], "lr": [1e-3, 1e-3], "grad_norm": [3.0, 8.0],
                      "tokens_per_s": [800.0, 810.0], "world_size": [1, 1], "val_loss": [nan, nan]})
    rows = [{"trial": "t_a", "lr": 1e-4, "_records": reported_records(a)},
            {"trial": "t_b", "lr": 1e-3, "_records": reported_records(b)}]
    out = tmp_path / "loss_curves.png"
    fig = plot_trials(rows, {"lr": SearchDim("lr", "grid", (1e-4, 1e-3))}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = {title: ax for ax, (_, title, _) in zip(fig.axes, PANELS, strict=False)}
    loss = axes["loss"]
    assert [line.get_label() for line in loss.lines] == ["t_a (lr=0.0001)", "t_b (lr=0.001)", "t_a (lr=0.0001) val_loss"]
    # Step 4 and 6 were reported twice: the later values count, in step order.
    assert loss.lines[0].get_xydata().tolist() == [[2, 5.0], [4, 4.1], [6, 3.4], [8, 3.0]]
    assert loss.lines[1].get_xydata().tolist() == [[2, 5.5], [4, 9.0]]
    assert loss.lines[2].get_xydata().tolist() == [[4, 4.4], [8, 3.9]]  # val_loss only where evaluated
    assert axes["learning rate"].lines[1].get_xydata().tolist() == [[2, 1e-3], [4, 1e-3]]
    assert axes["grad norm (before clipping)"].lines[0].get_xydata().tolist() == [[2, 2.0], [4, 1.6], [6, 1.1], [8, 0.9]]
    assert axes["throughput"].lines[1].get_xydata().tolist() == [[2, 800.0], [4, 810.0]]
    assert reported_records(None) == [] and reported_records(pd.DataFrame({"loss": [1.0]})) == []


TINY = ["--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64", "--num-hidden-layers", "2",
        "--num-attention-heads", "4", "--num-key-value-heads", "2", "--max-steps", "8", "--warmup-steps", "1",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--log-every", "2", "--checkpoint-every", "4",
        "--dtype", "fp32", "--val-samples", "16", "--eval-every", "4"]


@pytest.fixture(scope="module")
def sweep_data(tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("tune") / "data", num_sequences=240, seq_len=32, vocab_size=256)


@pytest.mark.ray
@pytest.mark.slow  # 3 trials, one at a time, a resumed sweep and a rerun: 5 Ray jobs
@pytest.mark.timeout(1200)
def test_sweep_interrupted_resumed_asha_stops_the_bad_trial_and_best_yaml_runs(ray_address, sweep_data, tmp_path):
    """3 trials x 1 worker x 24 steps, one at a time: interrupt after the first finishes, --resume.

    lr 1.0 is the clearly bad trial: ASHA (grace 4 steps) stops it before its last step. It comes last: Tune saves
    the searcher but not the scheduler, so the resumed sweep's ASHA starts with empty rungs and needs a trial
    before it, in the resumed sweep, to compare against (a bad trial alone at its rung runs to the end).
    """
    import signal
    import subprocess
    import sys
    import time

    from helpers import ROOT

    env = run_env(ray_address)
    tiny = [a if a != "8" else "24" for a in TINY]  # --max-steps 24
    args = ["--data", str(sweep_data), *tiny, "--run-dir", str(tmp_path / "sw"),
            "--search", "lr=grid:3e-3,1e-3,1.0", "--num-samples", "1", "--max-concurrent-trials", "1",
            "--workers-per-trial", "1", "--scheduler", "asha", "--grace-steps", "4", "--metric", "loss"]
    out = tmp_path / "sw"
    proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.tune", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 400
    while not list(out.glob("trials/*/checkpoint_00000024/COMPLETE.json")) and time.time() < deadline:
        assert proc.poll() is None, "the sweep ended before it could be interrupted"
        time.sleep(0.5)
    time.sleep(2)  # let Tune record the finished trial
    proc.send_signal(signal.SIGINT)  # Tune saves the sweep state and stops
    proc.wait(120)
    finished = sorted(out.glob("trials/*/checkpoint_00000024/COMPLETE.json"))
    assert finished
    first_log = finished[0].parents[1] / "metrics.jsonl"
    first_log_before = first_log.read_text()

    again = run_module("ray_jobs.tune", [*args, "--resume", "auto"], env=env, timeout=700)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming sweep sw" in again.stdout
    assert first_log.read_text() == first_log_before  # the finished trial was not run again

    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(float(r["lr"]) for r in rows) == [1e-3, 3e-3, 1.0]  # the table covers every trial
    losses = [float(r["loss"]) for r in rows]
    assert losses == sorted(losses)  # sorted by the metric
    bad = next(r for r in rows if float(r["lr"]) == 1.0)
    assert bad["status"] == "STOPPED" and int(bad["steps"]) < 24, bad
    assert any(r["status"] == "DONE" and int(r["steps"]) == 24 for r in rows)
    assert (out / "loss_curves.png").stat().st_size > 0

    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["lr"] == float(rows[0]["lr"]) and best["data"] == str(sweep_data)
    rerun = run_module("ray_jobs.pretrain", ["--config", str(out / "best.yaml"), "--max-steps", "4",
                                              "--num-workers", "1", "--run-dir", str(tmp_path / "from-best")],
                                             env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # The rerun trained with the best trial's lr (the trials' lrs all differ), to the 4 steps asked for.
    state = json.loads(sorted((tmp_path / "from-best").glob("checkpoint_*/state.json"))[-1].read_text())
    assert state["train_config"]["lr"] == float(rows[0]["lr"]) and state["optimizer_step"] == 4

    exists = run_module("ray_jobs.tune", args, env=env)
    assert exists.returncode == 2 and "add --resume" in exists.stderr


@pytest.mark.ray
@pytest.mark.slow  # a sweep of 2 trials, each a Ray Train run
@pytest.mark.timeout(600)
def test_sweep_reports_val_loss_and_ranks_trials_by_a_score_of_eval_tasks(ray_address, sweep_data, tmp_path):
    # Each trial's checkpoints scored beside it (--eval-tasks), the trials ranked by a score Tune maximises
    from test_eval_beside import write_task_list

    listing, _ = write_task_list(tmp_path / "tasks")
    env = run_env(ray_address)
    args = ["--data", str(sweep_data), *TINY, "--run-dir", str(tmp_path / "val"),
            "--search", "lr=grid:3e-4,3e-3", "--num-samples", "1", "--max-concurrent-trials", "2",
            "--workers-per-trial", "1", "--scheduler", "none", "--eval-tasks", str(listing), "--vocab-size", "320",
            "--metric", "eval/cloze/acc_norm"]
    proc = run_module("ray_jobs.tune", args, env=env, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sorted by eval/cloze/acc_norm" in proc.stdout
    with open(tmp_path / "val" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and all(r["val_loss"] not in ("", "None") for r in rows)
    assert float(rows[0]["eval/cloze/acc_norm"]) >= float(rows[1]["eval/cloze/acc_norm"])  # maximised: best first
    logs = sorted((tmp_path / "val" / "trials").glob("*/metrics.jsonl"))
    # each trial's folder keeps its effective config (its own lr), for pretrain --config; the sweep's folder none
    assert sorted(yaml.safe_load((p.parent / "config.yaml").read_text())["lr"] for p in logs) == [3e-4, 3e-3]
    assert not (tmp_path / "val" / "config.yaml").exists()
    assert len(logs) == 2 and all(any("val_loss" in json.loads(x) for x in p.read_text().splitlines()) for p in logs)
    last = []  # the score Tune ranked by is each trial's last checkpoint's, as the trial's eval.jsonl holds it
    for log in logs:
        scores = [json.loads(x) for x in (log.parent / "eval.jsonl").read_text().splitlines()]
        final = max((r for r in scores if r["task"] == "cloze"), key=lambda r: r["step"])
        assert final["step"] == 8
        last.append(final["metrics"]["acc_norm"])
    assert sorted(float(r["eval/cloze/acc_norm"]) for r in rows) == pytest.approx(sorted(last))
