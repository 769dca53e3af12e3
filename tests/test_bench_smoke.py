"""Smoke tests of the benchmarks in bench/: each module runs end to end on a tiny config, prints its
ratio line and writes its JSON (into a temporary folder through MINILM_BENCH_RESULTS, never into
bench/results/). The figures of such tiny runs mean nothing; these tests only keep the benchmarks
from rotting. The real runs and their numbers: bench/README.md, bench/RESULTS.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_env
from helpers import run_module

TINY_MODEL = ["--hidden-size", "64", "--num-hidden-layers", "2", "--vocab-size", "256"]


def run_bench(module: str, args: list[str], results: Path, env: dict | None = None) -> str:
    env = {**(env or os.environ), "MINILM_BENCH_RESULTS": str(results), "PYTHONUNBUFFERED": "1"}
    proc = run_module(module, args, env=env, timeout=240, check=True)
    return proc.stdout


def written(results: Path, name: str) -> dict:
    path = results / name
    assert path.is_file(), f"{name} not written to {results}"
    return json.loads(path.read_text())


def test_step(tmp_path):
    out = run_bench("bench.step", [*TINY_MODEL, "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2",
                                   "--warmup", "1", "--peak-size", "256"], tmp_path)
    assert "MoE / dense step time (fp32, 4 experts, top-1):" in out
    result = written(tmp_path, "step.json")["results"][0]
    assert [r["config"] for r in result["rows"]] == ["dense", "moe 4x top-1"]
    assert result["rows"][0]["active_params"] <= result["rows"][1]["active_params"] < result["rows"][1]["params"]


def test_step_times_a_further_optimizer_beside_the_first(tmp_path):
    run_bench("bench.step", [*TINY_MODEL, "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2", "--warmup",
                             "1", "--peak-size", "256", "--no-moe", "--optimizer", "muon", "adamw"], tmp_path)
    rows = written(tmp_path, "step.json")["results"][0]["rows"]
    assert [r["config"] for r in rows] == ["dense", "dense adamw"]
    assert rows[1]["over_dense"] == pytest.approx(rows[1]["step_s_median"] / rows[0]["step_s_median"])


def test_step_moe_experts_and_top_k(tmp_path):
    # bench.step's MoE rows (once bench.moe): every expert count and top-k at the dense model's active width
    out = run_bench("bench.step", [*TINY_MODEL, "--seq-len", "32", "--micro-batch-size", "2", "--steps", "1",
                                   "--warmup", "0", "--dtype", "bf16", "--experts", "4", "8", "--top-k", "1", "2",
                                   "--peak-size", "256"], tmp_path)
    for experts in (4, 8):
        for k in (1, 2):
            assert f"MoE / dense step time (bf16, {experts} experts, top-{k}):" in out
    rows = written(tmp_path, "step.json")["results"][0]["rows"]
    dense_active = rows[0]["active_params"]
    for r in rows[1:]:  # equal active parameters, up to the router (hidden x experts per layer)
        assert 0 < r["active_params"] - dense_active <= 2 * 64 * r["experts"]
        assert r["active_params"] < r["params"]


def test_checkpoint(tmp_path):
    out = run_bench("bench.checkpoint", ["--sizes", "64x1", "64x2", "--vocab-size", "256", "--seq-len", "32",
                                         "--micro-batch-size", "2", "--repeats", "1", "--checkpoint-every", "50",
                                         "--dir", str(tmp_path)], tmp_path / "results")
    assert "checkpoint cost (64x2," in out and "of training time at checkpoint_every 50" in out
    assert "async stall (64x2): " in out and "of the sync save" in out and "at a 0.2 s step" in out
    rows = written(tmp_path / "results", "checkpoint.json")["rows"]
    assert rows[0]["params"] < rows[1]["params"] and all(r["save_s"] > 0 and r["restore_s"] > 0 for r in rows)
    row = rows[1]
    assert row["sync_stall_s"] > 0 and row["async_stall_s"] > 0 and row["async_write_s"] >= row["async_stall_s"]
    assert row["sync_share"] == pytest.approx(row["sync_stall_s"] / (row["sync_stall_s"] + 50 * 0.2))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("bench-checkpoint-")] == []  # cleaned up


@pytest.mark.ray
@pytest.mark.nightly  # three fresh processes (one a Ray job) and two report rounds
def test_overhead(ray_address, tiny_data, tmp_path):
    out = run_bench("bench.overhead", ["--data", str(tiny_data), *TINY_MODEL, "--seq-len", "32",
                                       "--micro-batch-size", "4", "--global-batch-size", "16", "--steps", "6",
                                       "--log-every", "2", "--rounds", "1", "--threads", "1", "--reports", "2",
                                       "--report-intervals", "0.05,0.5"],
                    tmp_path, env=run_env(ray_address))
    assert "(c) Ray job, 1 worker, default flags" in out and "fixed cost per step over (a), paired by round:" in out
    result = written(tmp_path, "overhead.json")
    fixed = result["fixed_cost"]
    assert set(fixed["step_s_median"]) == {"bare", "trainer", "ray"} and min(fixed["step_s_median"].values()) > 0
    # 6 steps logged every 2, a checkpoint at step 4: the steady interval is 2 -> 4 (4 -> 6 holds the checkpoint)
    assert fixed["rounds"]["trainer"][0]["steps_counted"] == fixed["rounds"]["ray"][0]["steps_counted"] == 2
    assert fixed["checkpoint_s"] > 0 and 0 <= fixed["data_wait_frac"] < 1
    report = result["report_blocking"]
    assert (report["ray_default"]["poll_s"], report["minilm"]["poll_s"]) == (2.0, 0.1)
    assert [r["interval_s"] for r in report["minilm"]["rows"]] == [0.05, 0.5]
    assert "(the job's)" in out and "ratio: the job's setting over Ray's default" in out
