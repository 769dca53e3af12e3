"""`--storage-path s3://...` end to end, on an S3-compatible server started here (moto, tests/s3_server.py), in one
Ray run: a worker that hangs (the collective timeout, then Ray Train's restart from the last checkpoint), an upload
that fails on its third file (one error line; the previous checkpoint stays the one a resume takes), and a new driver
with `--resume auto`. The run ends bitwise equal to the uninterrupted `baseline` run (local storage, same world
size) and with the weights of the independent replay (tests/reference.py). With remote storage there is no local
run folder (no metrics.jsonl), so the replay is compared on the final weights.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import bitwise_equal, error_lines, max_rel_diff, wait_for
from inprocess import configs
from reference import replay
from runs import STEPS, hold_again_after, pretrain, ray_train_workers, start_pretrain, tiny_args
from runs import wait_until_workers_exit as wait_for_workers_to_exit
from safetensors.torch import load as load_safetensors

from minilm import checkpoint as C

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIMEOUT_S = 8  # --collective-timeout-s: long beside a tiny step, short for the suite


def s3_checkpoints(fs, run: str) -> dict[str, list[str]]:
    """checkpoint folder -> the files in it, in the run folder `run` of the bucket."""
    import pyarrow.fs as pafs

    found: dict[str, list[str]] = {}
    for info in fs.get_file_info(pafs.FileSelector(f"bucket/runs/{run}", recursive=True, allow_not_found=True)):
        rel = info.path.split(f"bucket/runs/{run}/", 1)[1]
        if rel.startswith("checkpoint_") and "/" in rel and info.type == pafs.FileType.File:
            folder, name = rel.split("/", 1)
            found.setdefault(folder, []).append(name)
    return found


def s3_complete(fs, run: str, folder: str) -> bool:
    """The folder holds every file its COMPLETE.json names (what `verify` checks, less the hashes)."""
    import json

    files = s3_checkpoints(fs, run).get(folder, [])
    if C.MARKER not in files:
        return False
    with fs.open_input_stream(f"bucket/runs/{run}/{folder}/{C.MARKER}") as f:
        return set(json.loads(f.read())["files"]) <= set(files)


def ended(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def raylet_lines_about(pid: int) -> str:
    """What this session's raylet logged about the worker process `pid` (why it was or was not killed)."""
    import ray

    log = Path(ray._private.worker._global_node.get_logs_dir_path()) / "raylet.out"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    ids = {line.split("worker_id=")[1].split()[0] for line in lines if f"pid {pid} " in line and "worker_id=" in line}
    return "\n".join(line for line in lines if f"pid {pid} " in line or f"pgid={pid} " in line
                     or any(worker_id in line for worker_id in ids))[-6000:] or f"no raylet lines about pid {pid}"


@pytest.mark.slow
def test_s3_storage_a_hung_worker_a_failed_upload_and_a_new_driver_end_as_the_uninterrupted_run(
        ray_address, run_data, baseline, s3, tmp_path):
    name, ids, hold, log = "s3run", tmp_path / "ids", tmp_path / "hold", tmp_path / "driver.log"
    fs = s3.filesystem()
    args = tiny_args(run_data, s3.uri("bucket/runs"), name, "--num-workers", "2", "--max-failures", "1",
                     "--collective-timeout-s", str(TIMEOUT_S), "--keep-checkpoints", "2")
    failing = s3.fail_uploads(f"bucket/runs/{name}/checkpoint_00000016/", at_file=3)
    hold.touch()  # both ranks wait after their first step
    proc = start_pretrain(ray_address, args, capture=False, log=log, MINILM_TEST_HOLD_FILE=str(hold),
                          MINILM_TEST_STEP_DELAY_S="0.25", MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    hung = None
    try:
        hold_again_after(lambda: s3_complete(fs, name, "checkpoint_00000008"), hold, proc,
                         "checkpoint 8 was complete in S3")
        workers = ray_train_workers()
        assert len(workers) == 2
        hung = workers[-1]
        hung.send_signal(signal.SIGSTOP)  # a rank that stops answering: the other one waits in its next all-reduce
        t0 = time.time()
        hold.unlink()
        wait_for(lambda: f"resumed run {name} at optimizer step " in log.read_text(), proc,
                 "the worker group's restart after the collective timeout", timeout=TIMEOUT_S + 120)
        restarted_after = time.time() - t0
        proc.wait(240)  # the upload of checkpoint 16 fails: no restarts are left
        # Ray ends the hung worker when it replaces the group, and the driver's exit ends its job's workers. Both
        # are asynchronous (SIGTERM, then SIGKILL) and under a loaded suite have come after the resume line, and
        # once more than 30 s after it.
        deadline = time.time() + 60
        while not ended(hung) and time.time() < deadline:
            time.sleep(0.5)
        assert ended(hung), raylet_lines_about(hung.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        if hung is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                hung.send_signal(signal.SIGCONT)
    s3.heal()
    wait_for_workers_to_exit()
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    assert f"timed out after {TIMEOUT_S} s (--collective-timeout-s)" in out and "did not answer" in out, out[-3000:]
    assert restarted_after >= TIMEOUT_S
    restarts = [line for line in out.splitlines() if f"resumed run {name} at optimizer step " in line]
    assert len(restarts) == 1 and "at optimizer step 8 " in restarts[0], restarts  # the last checkpoint
    assert failing.failed, "no upload was refused"
    errors = error_lines(out)
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: training failed: CheckpointError: could not write the checkpoint of "
                                f"optimizer step 16 to s3://***@bucket/runs/{name}/"
                                "checkpoint_00000016 (upload): "), errors[0]
    assert "minilm-secret" not in errors[0], errors[0]  # the storage's credentials are not printed
    assert "Access Denied" in errors[0] and "earlier checkpoints are intact" in errors[0] and "--resume auto" in \
        errors[0]
    assert not s3_complete(fs, name, "checkpoint_00000016")

    resumed = pretrain(ray_address, args + ["--resume", "auto"], MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    assert f"resumed run {name} at optimizer step 12 " in resumed.stdout  # the previous checkpoint
    assert f"step {STEPS}/{STEPS}" in resumed.stdout
    with fs.open_input_stream(f"bucket/runs/{name}/checkpoint_{STEPS:08d}/model.safetensors") as f:
        weights = load_safetensors(f.read())
    assert bitwise_equal(weights, baseline["weights"])
    ref = replay(*configs(), run_data, ids, STEPS)
    assert max_rel_diff(weights, ref.weights) < 1e-5
    # --keep-checkpoints 2: the newest two, and the one this driver resumed from (never pruned); the redone step 16
    # has a name of its own beside the torn upload of the first, which went with the pruning
    assert sorted(s3_checkpoints(fs, name)) == ["checkpoint_00000012", "checkpoint_00000016_1", f"checkpoint_{STEPS:08d}"]
    assert all(s3_complete(fs, name, f) for f in s3_checkpoints(fs, name))
