"""The Ray Train job end to end: the seed's interrupt-and-resume experiment, elastic resume, faults.

Every run is a `python -m ray_jobs.pretrain` subprocess joined to the session's local Ray, so the
log lines users see are what the tests read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_env
from helpers import ROOT, run_module
from safetensors.torch import load_file

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

STEPS = 20  # 15 steps per epoch on tiny_data (240 sequences, global batch 16): the runs cross an epoch


def tiny_args(data: Path, storage: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    return ["--data", str(data), "--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64",
            "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
            "--max-steps", str(steps), "--warmup-steps", "2", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--log-every", "4", "--checkpoint-every", "4", "--dtype", "fp32", "--storage-path", str(storage),
            "--name", name, *extra]


def pretrain(ray_address, args, check=True, **env):
    return run_module("ray_jobs.pretrain", args, env=run_env(ray_address, **env), timeout=300, check=check)


def final_weights(storage: Path, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(storage / name / f"checkpoint_{step:08d}" / "model.safetensors"))


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def consumed_ids(record_dir: Path) -> dict[int, list[int]]:
    """optimizer_step -> sorted sample ids consumed in that step over all ranks (no step is redone here)."""
    per_step: dict[int, list[int]] = {}
    for f in sorted(record_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["optimizer_step"], []).extend(rec["sample_ids"])
    return {s: sorted(ids) for s, ids in sorted(per_step.items())}


def start_until_checkpoint(ray_address, args: list[str], marker: Path, capture: bool) -> subprocess.Popen:
    """Start a slowed-down pretrain driver and return once `marker` (a checkpoint's COMPLETE.json) exists."""
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else \
        dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.pretrain", *args], cwd=ROOT,
                            env=run_env(ray_address, MINILM_TEST_STEP_DELAY_S="0.5"), **out)
    deadline = time.time() + 240
    while not marker.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert marker.is_file(), f"the run never wrote {marker.parent.name}"
    return proc


def ray_train_workers() -> list:
    import psutil

    return [p for p in psutil.process_iter(["cmdline"]) if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]


def lr_by_step(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["optimizer_step"]: r["lr"] for r in records}


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from helpers import make_prepared

    return make_prepared(tmp_path_factory.mktemp("data") / "tiny240", num_sequences=240, seq_len=32, vocab_size=256,
                         rows_per_shard=100)


@pytest.fixture(scope="module")
def baseline(ray_address, tiny_data, storage, tmp_path_factory):
    """An uninterrupted 2-worker run: the reference every resumed run is compared with."""
    ids = tmp_path_factory.mktemp("ids-baseline")
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "baseline", "--num-workers", "2",
                                           "--record-sample-ids", str(ids)))
    return {"weights": final_weights(storage, "baseline"), "ids": consumed_ids(ids), "log": proc.stdout}


def test_uninterrupted_run_logs_progress_and_loss_falls(baseline, storage):
    assert "starting run baseline fresh" in baseline["log"]
    assert f"step {STEPS}/{STEPS}" in baseline["log"]
    records = [json.loads(line) for line in (storage / "baseline" / "metrics.jsonl").read_text().splitlines()]
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

    model, tokenizer = load_pretrained(storage / "baseline" / "weights")
    assert not model.training and tokenizer is not None


def test_exit_after_steps_then_resume_auto_is_bitwise_equal(ray_address, tiny_data, storage, baseline, tmp_path):
    ids = tmp_path / "ids"
    first = pretrain(ray_address, tiny_args(tiny_data, storage, "split", "--num-workers", "2", "--exit-after-steps", "8",
                                            "--record-sample-ids", str(ids)))
    assert "exiting after optimizer step 8" in first.stdout
    assert (storage / "split" / "checkpoint_00000008" / "COMPLETE.json").is_file()
    second = pretrain(ray_address, tiny_args(tiny_data, storage, "split", "--num-workers", "2", "--resume", "auto",
                                             "--record-sample-ids", str(ids)))
    assert consumed_ids(ids) == baseline["ids"]  # same world size: the same samples at every optimizer step
    assert "resumed run split at optimizer step 8 (epoch 0, 128 samples): world size 2 -> 2, accumulation 2 -> 2" \
        in second.stdout
    assert "step 12/20" in second.stdout and "step 8/20" not in second.stdout  # continues at step 9
    assert bitwise_equal(final_weights(storage, "split"), baseline["weights"])
    steps = [json.loads(line)["optimizer_step"] for line in (storage / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


def test_driver_killed_then_resume_auto_is_bitwise_equal(ray_address, tiny_data, storage, baseline):
    args = tiny_args(tiny_data, storage, "killed", "--num-workers", "2")
    proc = start_until_checkpoint(ray_address, args, storage / "killed" / "checkpoint_00000008" / "COMPLETE.json",
                                  capture=False)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    time.sleep(3)  # let Ray reap the dead driver's controller and workers
    resumed = pretrain(ray_address, args + ["--resume", "auto"])
    assert "resumed run killed at optimizer step" in resumed.stdout
    assert bitwise_equal(final_weights(storage, "killed"), baseline["weights"])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size(ray_address, tiny_data, storage, baseline, tmp_path, before, after):
    name = f"ws{before}to{after}"
    ids = tmp_path / "ids"
    pretrain(ray_address, tiny_args(tiny_data, storage, name, "--num-workers", str(before), "--exit-after-steps", "6",
                                    "--record-sample-ids", str(ids)))
    second = pretrain(ray_address, tiny_args(tiny_data, storage, name, "--num-workers", str(after),
                                             "--record-sample-ids", str(ids)))
    acc = {1: 4, 2: 2}
    assert (f"resumed run {name} at optimizer step 6 (epoch 0, 96 samples): world size {before} -> {after}, "
            f"accumulation {acc[before]} -> {acc[after]}") in second.stdout
    assert max_rel_diff(final_weights(storage, name), baseline["weights"]) < 1e-5
    got = consumed_ids(ids)
    assert got == baseline["ids"]  # same global batch per optimizer step, none repeated or skipped
    lrs = lr_by_step(storage / name)
    base_lrs = lr_by_step(storage / "baseline")
    assert set(base_lrs) <= set(lrs)
    assert all(lrs[s] == base_lrs[s] for s in base_lrs)  # the schedule continues at the saved optimizer step


def test_sigkilled_worker_recovers_with_max_failures(ray_address, tiny_data, storage):

    args = tiny_args(tiny_data, storage, "workerkill", "--num-workers", "2", "--max-failures", "1")
    # checkpoint 4 is surely registered with Ray once checkpoint 8 is written
    proc = start_until_checkpoint(ray_address, args,
                                  storage / "workerkill" / "checkpoint_00000008" / "COMPLETE.json", capture=True)
    workers = ray_train_workers()
    assert workers, "no Ray Train worker process found"
    workers[0].send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed run workerkill at optimizer step" in out
    assert f"step {STEPS}/{STEPS}" in out
    steps = [json.loads(line)["optimizer_step"]
             for line in (storage / "workerkill" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))  # redone steps replaced, not appended


def test_resume_auto_skips_a_corrupt_latest_checkpoint(ray_address, tiny_data, storage, baseline):
    pretrain(ray_address, tiny_args(tiny_data, storage, "corrupt", "--num-workers", "2", "--exit-after-steps", "8"))
    latest = storage / "corrupt" / "checkpoint_00000008" / "model.safetensors"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.write_bytes(bytes(data))
    resumed = pretrain(ray_address, tiny_args(tiny_data, storage, "corrupt", "--num-workers", "2"))
    assert "skipping checkpoint" in resumed.stdout and "does not match its SHA-256" in resumed.stdout
    assert "resumed run corrupt at optimizer step 4" in resumed.stdout
    assert bitwise_equal(final_weights(storage, "corrupt"), baseline["weights"])


def test_resume_path_refuses_missing_partial_and_corrupt(ray_address, tiny_data, storage, baseline, tmp_path):
    good = storage / "baseline" / "checkpoint_00000020"
    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "COMPLETE.json").unlink()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    with open(corrupt / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    cases = {tmp_path / "missing": "does not exist", partial: "incomplete: COMPLETE.json is missing",
             corrupt: "corrupt: optimizer.pt does not match its SHA-256"}
    for path, message in cases.items():
        proc = pretrain(ray_address, tiny_args(tiny_data, storage, f"p-{path.name}", "--resume", str(path)), check=False)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert not (storage / f"p-{path.name}").exists()  # refused before any work started


def test_resume_path_continues_from_a_complete_checkpoint(ray_address, tiny_data, storage, baseline):
    start = storage / "baseline" / "checkpoint_00000012"
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "frompath", "--num-workers", "2", "--resume", str(start)))
    assert "resumed run frompath at optimizer step 12" in proc.stdout
    assert bitwise_equal(final_weights(storage, "frompath"), baseline["weights"])


def test_world_size_that_breaks_the_global_batch_is_refused(ray_address, tiny_data, storage):
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "badws", "--num-workers", "3"), check=False)
    assert proc.returncode == 2
    assert "valid world sizes: 1, 2, 4" in proc.stderr and "Traceback" not in proc.stderr


def test_moe_run_reports_aux_loss_and_exports_minimind_weights(ray_address, tiny_data, storage, tmp_path):
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "moe", "--num-workers", "2", "--use-moe", steps=8))
    assert "expert_load" in proc.stdout
    last = json.loads((storage / "moe" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["aux_loss"] > 0
    assert last["loss"] == pytest.approx(last["lm_loss"] + last["aux_loss"], rel=1e-5)
    out = tmp_path / "export"
    exp = run_module("ray_jobs.export", ["--checkpoint", str(storage / "moe" / "checkpoint_00000008"),
                                         "--output", str(out), "--format", "minimind"], check=True)
    assert "pretrain_64_moe.pth" in exp.stdout
    from minilm.config import ModelConfig
    from minilm.model import MiniMindForCausalLM

    cfg = ModelConfig(**json.loads((out / "config.json").read_text()))
    model = MiniMindForCausalLM(cfg)
    state = torch.load(out / "pretrain_64_moe.pth", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    assert any(k.startswith("model.layers.0.mlp.experts.3.") for k in state)


@pytest.mark.skipif(os.environ.get("MINILM_SKIP_DEMO") == "1", reason="MINILM_SKIP_DEMO=1")
def test_zero_argument_run_finishes_and_loss_falls(ray_address, tmp_path):
    env = run_env(ray_address, MINILM_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "ray_jobs.pretrain"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["optimizer_step"] == 200
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "=== run summary ===" in proc.stdout


def test_sigterm_to_a_worker_checkpoints_at_the_step_boundary(ray_address, tiny_data, storage, baseline):

    args = tiny_args(tiny_data, storage, "sigterm", "--num-workers", "2", "--max-failures", "1")
    proc = start_until_checkpoint(ray_address, args, storage / "sigterm" / "checkpoint_00000004" / "COMPLETE.json",
                                  capture=True)
    time.sleep(1.0)  # mid-way between checkpoints
    workers = ray_train_workers()
    assert workers
    workers[-1].send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    import re

    stopped = re.search(r"SIGTERM at optimizer step (\d+): checkpoint written", out)
    assert stopped, out[-3000:]
    k = int(stopped.group(1))
    assert k % 4 != 0 or k > 4  # an extra checkpoint at the boundary, not the periodic one
    assert f"resumed run sigterm at optimizer step {k} " in out  # nothing redone
    assert bitwise_equal(final_weights(storage, "sigterm"), baseline["weights"])


def test_a_nan_step_is_skipped_and_counted(ray_address, tiny_data, storage):
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "nan1", "--num-workers", "2", steps=8),
                    MINILM_TEST_NAN_AT_STEPS="5")
    records = [json.loads(line) for line in (storage / "nan1" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["optimizer_step"] == 8 and records[-1]["skipped_steps"] == 1
    assert "skipped 1" in proc.stdout


def test_nan_steps_in_a_row_stop_the_run_naming_the_steps(ray_address, tiny_data, storage):
    proc = pretrain(ray_address, tiny_args(tiny_data, storage, "nan3", "--num-workers", "2",
                                           "--max-nonfinite-steps", "3", steps=12),
                    check=False, MINILM_TEST_NAN_AT_STEPS="5,6,7")
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert "3 optimizer steps in a row (5..7) had a non-finite loss or gradient norm" in error[0]

