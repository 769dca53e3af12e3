"""The Ray Train job end to end: a 2-worker run and a resume at another world size, each checked against the
independent replay of tests/reference.py; a world size that breaks the global batch; the zero-argument demo.

Every run is a `python -m ray_jobs.pretrain` subprocess joined to the session's local Ray, so the log lines users
see are what the tests read. The loop's logic (resume at the same world size, resume by path, corrupt
checkpoints, a full disk, NaN steps, MoE) is tested without Ray in tests/test_trainer.py; Ray's own mechanisms
(a killed driver, a killed worker, SIGTERM, a NaN stop through Ray) in tests/faults/, elastic resizes and drains
in tests/test_elastic.py. The shared `baseline` run is in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import run_env
from helpers import assert_quoted, metrics, quoted_block
from inprocess import configs
from reference import check_run, replay
from runs import STEPS, final_weights, pretrain, tiny_args

from ray_jobs.cli import available_cores

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow  # the baseline run (~27 s)
def test_uninterrupted_run_logs_progress_and_is_the_reference_replay(baseline, run_data, run_storage):
    assert "starting run baseline fresh" in baseline["log"]
    assert "1 CPU thread(s) per worker" in baseline["log"]
    assert f"step {STEPS}/{STEPS}" in baseline["log"]
    assert "fault injection is ON for this run: record_sample_ids=" in baseline["stderr"]  # a test switched it on
    records = metrics(run_storage / "baseline")
    steps = [r["optimizer_step"] for r in records]
    assert steps == [4, 8, 12, 16, 20]
    for key in ("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "samples_seen", "epoch",
                "world_size", "accumulation_steps"):
        assert key in records[-1], key
    assert records[-1]["samples_seen"] == STEPS * 16
    # 2 DDP workers, accumulation 2 each: the replay in one process, accumulation 4 (reduction order differs)
    check_run(replay(*configs(), run_data, baseline["ids_dir"], STEPS), baseline["weights"], records)
    assert records[-1]["loss"] < records[0]["loss"]
    # the checkpoints uploaded while training went on (async) leave Ray nothing to complain of in its own log
    assert "Failed to delete the local checkpoint" not in (run_storage / "baseline" / "ray-workers.log").read_text()
    # the weights export sits next to the run, and loads for inference
    from minilm import load_pretrained

    model, tokenizer = load_pretrained(run_storage / "baseline" / "weights")
    assert not model.training and tokenizer is not None


@pytest.mark.slow
def test_resume_at_another_world_size_with_every_tracker(ray_address, run_data, run_storage, tmp_path):
    """2 workers stopped at step 6, continued by 1: the replay's weights, lrs and losses; the same samples at every
    step; and TensorBoard, MLflow and W&B (offline) each keep one run across the resume."""
    name, ids = "ws2to1", tmp_path / "ids"
    trackers = ["--tracker", "tensorboard,mlflow", "--tracker", "wandb"]
    env = {**tracker_env(tmp_path), "MINILM_TEST_RECORD_SAMPLE_IDS": str(ids)}
    pretrain(ray_address, tiny_args(run_data, run_storage, name, "--num-workers", "2", "--exit-after-steps", "6",
                                    *trackers), **env)
    second = pretrain(ray_address, tiny_args(run_data, run_storage, name, "--num-workers", "1", *trackers), **env)
    assert (f"resumed run {name} at optimizer step 6 (epoch 0, 96 samples): world size 2 -> 1, "
            f"accumulation 2 -> 4") in second.stdout
    check_run(replay(*configs(), run_data, ids, STEPS), final_weights(run_storage, name), metrics(run_storage / name))
    check_one_tracker_run_each(run_storage / name, world_sizes=(2, 1))


def tracker_env(tmp_path) -> dict:
    home = tmp_path / "wandb-home"
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}


def check_one_tracker_run_each(run_dir, world_sizes) -> None:
    """TensorBoard, MLflow and W&B each hold one run whose step axis is strictly increasing and whose
    points are metrics.jsonl's (read back with each tracker's own reader, see tests/test_trackers.py)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trackers import check_series, jsonl_points, read_wandb_offline

    expected = jsonl_points(run_dir)
    steps = sorted(expected)
    assert steps == [4, 6, 8, 12, 16, 20]  # 6: the --exit-after-steps checkpoint
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    check_series(series, expected, rel=1e-6)  # event files hold float32
    assert [v for _, v in series["world_size"]] == [world_sizes[0]] * 2 + [world_sizes[1]] * 4

    state = json.loads((run_dir / f"checkpoint_{STEPS:08d}" / "state.json").read_text())["trackers"]
    client = MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]] and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["world_size"] == str(world_sizes[0])  # hyperparameters once, from the first job
    check_series({name: [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, name),
                                                           key=lambda m: m.timestamp)]
                  for name in runs[0].data.metrics}, expected)

    run_ids, config, history = read_wandb_offline(run_dir)
    assert run_ids == {state["wandb"]["run_id"]} and config["world_size"] == world_sizes[0]
    assert [step for step, _ in history] == steps
    assert [items["loss"] for _, items in history] == pytest.approx([expected[s]["loss"] for s in steps])


def test_world_size_that_breaks_the_global_batch_is_refused(ray_address, run_data, run_storage):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "badws", "--num-workers", "17"), check=False)
    assert proc.returncode == 2  # 16 sequences a step: a 17th worker would have none
    assert "valid world sizes: 1-16" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # ~13 s
def test_the_zero_argument_preset_trains_in_process(ray_address, tmp_path, monkeypatch):
    """What `python -m ray_jobs.pretrain` with no argument trains (the nightly test below runs it whole): the demo
    preset on the built-in corpus, a few steps of it through the Trainer in this process."""
    from minilm.cli import DEMO_PRESET
    from minilm.data import open_prepared
    from minilm.options import build_configs
    from minilm.train import LocalLauncher
    from minilm.trainer import Dataset, RunOptions, Trainer
    from ray_jobs.cli import RayOptions
    from ray_jobs.demo_data import demo_data_dir
    from ray_jobs.pretrain import build_parser

    cfgs = build_configs(build_parser().parse_args([]), {}, RayOptions, demo=True)
    for key, value in DEMO_PRESET.items():
        assert getattr(cfgs.model if hasattr(cfgs.model, key) else cfgs.train, key) == value, key
    assert cfgs.run == RayOptions() and cfgs.train.max_steps == 100
    cfgs.train.max_steps, cfgs.train.dtype = 2, "fp32"
    assert cfgs.train.warmup_steps == 0  # the preset's warmup fits any run, however short
    data = Dataset.prepared(open_prepared(demo_data_dir(cfgs.train.seq_len, cfgs.model.vocab_size)))
    lines = []
    trainer = Trainer(cfgs.model, cfgs.train, RunOptions(name="preset"), data,
                      LocalLauncher(data, cfgs.train.micro_batch_size, say=lines.append))
    assert trainer.fit() == "finished"
    assert "4.98M parameters" in lines[0] and "world size 1 x accumulation 4 x micro-batch 8" in lines[0]


def console_of_a_user(proc: subprocess.CompletedProcess, runs: list) -> None:
    """The console a person reads (issue #17): minilm's lines; Ray's chatter in the run's ray-workers.log."""
    console = proc.stdout + proc.stderr
    threads = max(1, available_cores() // 2)  # 2 workers share the cores, whatever the Ray's logical CPUs
    assert f"{threads} CPU thread(s) per worker" in console
    for chatter in ("TrainingReport(", "core_worker.cc", "(RayTrainWorker pid=", "PYTHON worker processes"):
        assert chatter not in console, f"{chatter!r} on the console:\n{console[-3000:]}"
    assert [line for line in console.splitlines() if " E " in line] == []
    assert (runs[0] / "ray-workers.log").is_file()


@pytest.mark.slow  # the demo's 2-worker job on its 5M-parameter preset
def test_zero_argument_job_for_a_few_steps_keeps_the_console_readable(ray_address, tmp_path):
    # The demo's job (the preset on the built-in corpus, 2 workers) cut to 4 steps with a report every 2: the
    # console a user of `make demo` sees, from the start line to the summary. The whole 100 steps: nightly below.
    env = run_env(ray_address)  # the session's MINILM_CACHE: the demo corpus the preset test prepared
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain", "--max-steps", "4", "--log-every", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["optimizer_step"] for r in records] == [2, 4]
    assert "=== run summary ===" in proc.stdout and "step 4/4" in proc.stdout
    console_of_a_user(proc, runs)
    assert_quoted(quoted_block("README.md", "run minilm-"), proc.stdout + proc.stderr)  # the README's `make demo`


@pytest.mark.nightly
@pytest.mark.skipif(os.environ.get("MINILM_SKIP_DEMO") == "1", reason="MINILM_SKIP_DEMO=1")
def test_zero_argument_run_finishes_and_loss_falls(ray_address, tmp_path):
    env = run_env(ray_address)
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["optimizer_step"] == 100
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "=== run summary ===" in proc.stdout
    console_of_a_user(proc, runs)
