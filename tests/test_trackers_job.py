"""Trackers through the Ray job: one run stopped and resumed at another world size keeps one tracker run
per tracker, with a strictly increasing step axis whose points are metrics.jsonl's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_env
from helpers import make_prepared, run_module
from test_trackers import check_series, jsonl_points, read_wandb_offline

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def args(data: Path, storage: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64",
            "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
            "--use-moe", "--num-experts", "2", "--max-steps", "16", "--warmup-steps", "2",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--log-every", "4", "--checkpoint-every", "8",
            "--val-samples", "16", "--dtype", "fp32", "--storage-path", str(storage), "--name", "tracked",
            "--tracker", "tensorboard,mlflow", "--tracker", "wandb", *extra]


@pytest.fixture(scope="module")
def tracked_run(ray_address, tmp_path_factory) -> Path:
    data = make_prepared(tmp_path_factory.mktemp("data") / "d", num_sequences=160, seq_len=32, vocab_size=256)
    storage = tmp_path_factory.mktemp("runs")
    home = tmp_path_factory.mktemp("wandb-home")
    env = run_env(ray_address, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(home / "config"),
                  WANDB_CACHE_DIR=str(home / "cache"), WANDB_DATA_DIR=str(home / "data"))
    first = run_module("ray_jobs.pretrain", args(data, storage, "--num-workers", "2", "--exit-after-steps", "8"),
                       env=env, timeout=300, check=True)
    assert "exiting after optimizer step 8" in first.stdout
    run_module("ray_jobs.pretrain", args(data, storage, "--num-workers", "1"), env=env, timeout=300, check=True)
    return storage / "tracked"


def test_one_tensorboard_run_across_the_resume(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    expected = jsonl_points(tracked_run)
    assert sorted(expected) == [4, 8, 12, 16]
    check_series(series, expected, rel=1e-6)
    assert [v for _, v in series["world_size"]] == [2, 2, 1, 1]
    assert "val_loss" in series and "expert_load/layer0/expert1" in series


def test_one_mlflow_run_across_the_resume(tracked_run):
    from mlflow.tracking import MlflowClient

    state = json.loads((tracked_run / "checkpoint_00000016" / "state.json").read_text())["trackers"]
    client = MlflowClient(tracking_uri=state["mlflow"]["tracking_uri"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [state["mlflow"]["run_id"]]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["model.use_moe"] == "True" and runs[0].data.params["world_size"] == "2"
    series = {name: [(m.step, m.value) for m in sorted(client.get_metric_history(runs[0].info.run_id, name),
                                                       key=lambda m: m.timestamp)]
              for name in runs[0].data.metrics}
    check_series(series, jsonl_points(tracked_run))


def test_one_wandb_run_across_the_resume(tracked_run):
    run_ids, config, history = read_wandb_offline(tracked_run)
    state = json.loads((tracked_run / "checkpoint_00000016" / "state.json").read_text())["trackers"]
    assert run_ids == {state["wandb"]["run_id"]}
    assert [step for step, _ in history] == [4, 8, 12, 16]
    assert config["world_size"] == 2 and config["model"]["use_moe"] is True
    expected = jsonl_points(tracked_run)
    assert [items["loss"] for _, items in history] == pytest.approx([expected[s]["loss"] for s in (4, 8, 12, 16)])
