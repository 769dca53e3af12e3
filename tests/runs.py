"""Helpers for tests that run `python -m ray_jobs.pretrain` end to end (tests/test_pretrain.py, tests/faults/).

Every run is a subprocess joined to the session's local Ray (the `ray_address` fixture), so the log
lines users see are what the tests read. The shared fixtures (`run_data`, `run_storage`, `baseline`)
live in tests/conftest.py: the uninterrupted baseline run is made once per session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import run_env
from helpers import ROOT, metrics, run_module, wait_for
from safetensors.torch import load_file

from minilm.safety import join_uri

STEPS = 20  # 15 steps per epoch on run_data (240 sequences, global batch 16): the runs cross an epoch


def tiny_args(data: Path, storage: Path, name: str, *extra: str, steps: int = STEPS) -> list[str]:
    """A 2-layer, hidden-64 fp32 model; a log line and a checkpoint every 4 optimizer steps."""
    return ["--data", str(data), "--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64",
            "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
            "--max-steps", str(steps), "--warmup-steps", "2", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--log-every", "4", "--checkpoint-every", "4", "--dtype", "fp32", "--run-dir", join_uri(str(storage), name),
            "--lr", "1e-3", "--cpus-per-worker", "1",
            # AdamW, not the default Muon: the replay (tests/reference.py) then recomputes the run with torch's own
            # optimizer, no code of minilm's
            "--optimizer", "adamw", *extra]


def pretrain(ray_address, args, check=True, **env):
    return run_module("ray_jobs.pretrain", args, env=run_env(ray_address, **env), timeout=300, check=check)


STARTED: list[subprocess.Popen] = []  # drivers start_pretrain started: end_leftover_runs ends those a test left


def start_pretrain(ray_address, args: list[str], capture: bool, log: Path | None = None, **env) -> subprocess.Popen:
    """capture: stdout and stderr through a pipe (read it before it fills); log: into that file instead."""
    cmd, env = [sys.executable, "-m", "ray_jobs.pretrain", *args], run_env(ray_address, **env)
    if log is not None:
        with open(log, "w") as f:  # the driver keeps its own copy of the file descriptor
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    else:
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) if capture else \
            dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, **out)
    STARTED.append(proc)
    return proc


def end_leftover_runs() -> None:
    """Kill the drivers a test left running (a failed test's, held or slowed down) and the session Ray's Train
    workers that outlive them, so one failure does not starve every later test of CPUs."""
    for p in STARTED:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    STARTED.clear()
    try:
        wait_until_workers_exit(timeout=30)  # Ray ends a dead driver's workers itself, usually within seconds
    except AssertionError:
        for w in ray_train_workers():
            w.kill()


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint folder whose files are all there and match their hashes (not merely a marker copied first)."""
    from minilm.checkpoint import CheckpointError, verify

    try:
        verify(checkpoint)
        return True
    except CheckpointError:
        return False


def final_weights(storage: Path, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_file(str(storage / name / f"checkpoint_{step:08d}" / "model.safetensors"))



def hold_again_after(checkpoint_done, hold: Path, proc: subprocess.Popen, what: str) -> list[Path]:
    """Both ranks are held after step 1 (MINILM_TEST_HOLD_FILE=`hold`, touched before the start): release them, wait
    for `checkpoint_done()` (`what`), then hold them again; returns the two ranks' hold files (each names its step)."""
    held = [hold.with_name(f"{hold.name}.rank{r}") for r in (0, 1)]
    wait_for(lambda: all(h.is_file() for h in held), proc, "both ranks were held after step 1")
    for h in held:
        h.unlink()
    hold.unlink()
    wait_for(checkpoint_done, proc, what)
    hold.touch()
    wait_for(lambda: all(h.is_file() for h in held), proc, "both ranks were held again")
    return held



def consumed_ids(record_dir: Path) -> dict[int, list[int]]:
    """optimizer_step -> sorted sample ids consumed in that step over all ranks (no step is redone here)."""
    per_step: dict[int, list[int]] = {}
    for f in sorted(record_dir.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["optimizer_step"], []).extend(rec["sample_ids"])
    return {s: sorted(ids) for s, ids in sorted(per_step.items())}



def metric_steps(run_dir: Path) -> list[int]:
    return [r["optimizer_step"] for r in metrics(run_dir)]


def lr_by_step(run_dir: Path) -> dict[int, float]:
    return {r["optimizer_step"]: r["lr"] for r in metrics(run_dir)}


def ray_train_workers() -> list:
    """Ray Train worker processes of this session's local Ray (its raylet is a child of the pytest process):
    other Ray instances on the machine are left alone."""
    import os

    import psutil

    me = os.getpid()
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if "RayTrainWorker" not in " ".join(p.info["cmdline"] or []):
            continue
        try:
            if any(parent.pid == me for parent in p.parents()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return sorted(found, key=lambda p: p.create_time())  # the newest last


def timeline(run_dir: Path) -> list[dict]:
    """world_size.csv's rows, typed (minilm.timeline's own reader)."""
    from minilm.timeline import WorldSizeTimeline

    return WorldSizeTimeline(run_dir).rows()


def wait_until_workers_exit(timeout: float = 90) -> None:
    """After a driver is killed, wait until Ray has ended its workers (they could otherwise write on)."""
    deadline = time.time() + timeout
    while ray_train_workers():
        assert time.time() < deadline, "Ray Train workers of a killed driver are still running"
        time.sleep(0.5)
