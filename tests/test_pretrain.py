"""The Ray Train job end to end: the seed's interrupt-and-resume experiment, elastic resume, resume by path.

Every run is a `python -m ray_jobs.pretrain` subprocess joined to the session's local Ray, so the
log lines users see are what the tests read. Faults (killed processes, corrupt checkpoints, SIGTERM,
NaN steps, a full disk) are in tests/faults/; the shared `baseline` run is in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_env
from helpers import run_module
from runs import (
    STEPS,
    bitwise_equal,
    consumed_ids,
    final_weights,
    lr_by_step,
    max_rel_diff,
    metric_steps,
    pretrain,
    tiny_args,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_uninterrupted_run_logs_progress_and_loss_falls(baseline, run_storage):
    assert "starting run baseline fresh" in baseline["log"]
    assert f"step {STEPS}/{STEPS}" in baseline["log"]
    records = [json.loads(line) for line in (run_storage / "baseline" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["optimizer_step"] for r in records]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    assert records[-1]["loss"] < records[0]["loss"]
    for key in ("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "samples_seen", "epoch",
                "world_size", "accumulation_steps"):
        assert key in records[-1], key
    assert records[-1]["samples_seen"] == STEPS * 16
    # every sample of epoch 0 (15 steps x 16 = 240) consumed exactly once
    epoch0 = [i for s in range(1, 16) for i in baseline["ids"][s]]
    assert sorted(epoch0) == list(range(240))
    # the weights export sits next to the run, and loads for inference
    from minilm import load_pretrained

    model, tokenizer = load_pretrained(run_storage / "baseline" / "weights")
    assert not model.training and tokenizer is not None


@pytest.mark.slow
def test_exit_after_steps_then_resume_auto_is_bitwise_equal(ray_address, run_data, run_storage, baseline, tmp_path):
    ids = tmp_path / "ids"
    first = pretrain(ray_address, tiny_args(run_data, run_storage, "split", "--num-workers", "2",
                                            "--exit-after-steps", "8", "--record-sample-ids", str(ids)))
    assert "exiting after optimizer step 8" in first.stdout
    assert (run_storage / "split" / "checkpoint_00000008" / "COMPLETE.json").is_file()
    second = pretrain(ray_address, tiny_args(run_data, run_storage, "split", "--num-workers", "2", "--resume", "auto",
                                             "--record-sample-ids", str(ids)))
    assert consumed_ids(ids) == baseline["ids"]  # same world size: the same samples at every optimizer step
    assert "resumed run split at optimizer step 8 (epoch 0, 128 samples): world size 2 -> 2, accumulation 2 -> 2" \
        in second.stdout
    assert "step 12/20" in second.stdout and "step 8/20" not in second.stdout  # continues at step 9
    assert bitwise_equal(final_weights(run_storage, "split"), baseline["weights"])
    steps = metric_steps(run_storage / "split")
    assert steps == sorted(set(steps))


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(ray_address, run_data, run_storage, baseline, tmp_path, before, after):
    """Also, 2 -> 1 runs with every tracker (W&B offline): one tracker run each across the resume."""
    name = f"ws{before}to{after}"
    ids = tmp_path / "ids"
    trackers = ["--tracker", "tensorboard,mlflow", "--tracker", "wandb"] if before == 2 else []
    env = tracker_env(tmp_path) if trackers else {}
    pretrain(ray_address, tiny_args(run_data, run_storage, name, "--num-workers", str(before), "--exit-after-steps", "6",
                                    "--record-sample-ids", str(ids), *trackers), **env)
    second = pretrain(ray_address, tiny_args(run_data, run_storage, name, "--num-workers", str(after),
                                             "--record-sample-ids", str(ids), *trackers), **env)
    acc = {1: 4, 2: 2}
    assert (f"resumed run {name} at optimizer step 6 (epoch 0, 96 samples): world size {before} -> {after}, "
            f"accumulation {acc[before]} -> {acc[after]}") in second.stdout
    assert max_rel_diff(final_weights(run_storage, name), baseline["weights"]) < 1e-5
    got = consumed_ids(ids)
    assert got == baseline["ids"]  # same global batch per optimizer step, none repeated or skipped
    lrs = lr_by_step(run_storage / name)
    base_lrs = lr_by_step(run_storage / "baseline")
    assert set(base_lrs) <= set(lrs)
    assert all(lrs[s] == base_lrs[s] for s in base_lrs)  # the schedule continues at the saved optimizer step
    if trackers:
        check_one_tracker_run_each(run_storage / name, world_sizes=(before, after))


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


def test_resume_path_continues_from_a_complete_checkpoint(ray_address, run_data, run_storage, baseline):
    start = run_storage / "baseline" / "checkpoint_00000012"
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "frompath", "--num-workers", "2",
                                           "--resume", str(start)))
    assert "resumed run frompath at optimizer step 12" in proc.stdout
    assert bitwise_equal(final_weights(run_storage, "frompath"), baseline["weights"])


def test_world_size_that_breaks_the_global_batch_is_refused(ray_address, run_data, run_storage):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "badws", "--num-workers", "3"), check=False)
    assert proc.returncode == 2
    assert "valid world sizes: 1, 2, 4" in proc.stderr and "Traceback" not in proc.stderr


def test_moe_run_reports_aux_loss_and_exports_minimind_weights(ray_address, run_data, run_storage, tmp_path):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "moe", "--num-workers", "2", "--use-moe", steps=8))
    assert "expert_load" in proc.stdout
    last = json.loads((run_storage / "moe" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["aux_loss"] > 0
    assert last["loss"] == pytest.approx(last["lm_loss"] + last["aux_loss"], rel=1e-5)
    out = tmp_path / "export"
    exp = run_module("ray_jobs.export", ["--checkpoint", str(run_storage / "moe" / "checkpoint_00000008"),
                                         "--output", str(out), "--format", "minimind"], check=True)
    assert "pretrain_64_moe.pth" in exp.stdout
    from minilm.config import ModelConfig
    from minilm.model import MiniMindForCausalLM

    cfg = ModelConfig(**json.loads((out / "config.json").read_text()))
    model = MiniMindForCausalLM(cfg)
    state = torch.load(out / "pretrain_64_moe.pth", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    assert any(k.startswith("model.layers.0.mlp.experts.3.") for k in state)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MINILM_SKIP_DEMO") == "1", reason="MINILM_SKIP_DEMO=1")
def test_zero_argument_run_finishes_and_loss_falls(ray_address, tmp_path):
    env = run_env(ray_address, MINILM_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["optimizer_step"] == 100
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "=== run summary ===" in proc.stdout
