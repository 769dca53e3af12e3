"""A rank that stops answering, under torchrun (plain DDP, gloo): the run ends at the collective timeout with one
error line and exit code 1, and `--resume auto` continues bitwise. Under Ray: tests/faults/test_object_storage.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_env
from helpers import ROOT, bitwise_equal, free_port, metrics, wait_for
from inprocess import STEPS, checkpoint_weights, configs, torchrun, train_flags
from reference import check_run, replay
from runs import hold_again_after

from minilm import checkpoint as C

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 8  # --collective-timeout-s here: long beside a tiny step or checkpoint, short for the suite


def rank_process(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and "minilm.train" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            pass
    raise AssertionError(f"no process of rank {rank} under torchrun")


def rank_logs(log_dir: Path, rank: int, stream: str) -> str:
    return "".join(p.read_text() for p in sorted(log_dir.rglob(f"attempt_*/{rank}/{stream}.log")))


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_at_the_collective_timeout_and_resume_is_bitwise_equal(run_data, tmp_path):
    """Both ranks held after checkpoint 8, rank 1 SIGSTOPped, rank 0 let go: rank 0 waits in the next step's
    all-reduce, gives up after --collective-timeout-s and says so in one line; rank 1, continued after that,
    finds its peer gone and leaves with one line too (no traceback from either). torchrun exits 1, and the
    resumed run (2 ranks again) ends bitwise equal to an uninterrupted 2-rank run, and as the replay computes."""
    run_dir, ids, hold, logs = tmp_path / "hung", tmp_path / "ids", tmp_path / "hold", tmp_path / "logs"
    ids.mkdir()
    env = {"MINILM_TEST_RECORD_SAMPLE_IDS": str(ids)}
    flags = train_flags(run_data, run_dir) + ["--collective-timeout-s", str(TIMEOUT_S)]
    hold.touch()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "--log-dir", str(logs), "--redirects", "3", "-m", "minilm.train", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=run_env(None, OMP_NUM_THREADS="1", MINILM_TEST_HOLD_FILE=str(hold),
                                        MINILM_TEST_STEP_DELAY_S="0.3", **env))
    try:
        held = hold_again_after(lambda: (run_dir / "checkpoint_00000008" / C.MARKER).is_file(), hold, proc,
                                "checkpoint 8")
        step = int(held[0].read_text())
        assert 8 <= step < 12, step
        hung = rank_process(proc, 1)
        hung.send_signal(signal.SIGSTOP)
        t0 = time.time()
        hold.unlink()
        wait_for(lambda: "error:" in rank_logs(logs, 0, "stderr"), proc, "rank 0's error line", timeout=TIMEOUT_S + 60)
        waited = time.time() - t0
        hung.send_signal(signal.SIGCONT)  # a straggler that comes back after the others gave up
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    err0, err1 = rank_logs(logs, 0, "stderr"), rank_logs(logs, 1, "stderr")
    errors0 = [line for line in err0.splitlines() if not line.startswith("warning: MINILM_TESTING=1")]
    assert len(errors0) == 1 and errors0[0].startswith(
        f"error: training failed: a collective on rank 0 timed out after {TIMEOUT_S} s (--collective-timeout-s): "
        "rank 1 did not answer"), err0
    assert "continue with --resume auto" in errors0[0]
    assert TIMEOUT_S <= waited < TIMEOUT_S + 30, waited
    errors1 = [line for line in err1.splitlines() if not line.startswith("warning: MINILM_TESTING=1")]
    assert "Traceback" not in err1 and len(errors1) <= 1, err1  # torchrun may end it before it says anything
    assert all(line.startswith("error: training failed: ") for line in errors1), err1
    assert C.RunFolder(run_dir).newest_complete() == "checkpoint_00000008"

    resumed = torchrun(2, train_flags(run_data, run_dir), **env)
    assert "resumed run hung at optimizer step 8 " in resumed.stdout
    straight = tmp_path / "straight"
    torchrun(2, train_flags(run_data, straight))
    a, b = checkpoint_weights(run_dir), checkpoint_weights(straight)
    assert bitwise_equal(a, b), "resumed != uninterrupted (2 ranks)"
    check_run(replay(*configs(), run_data, ids, STEPS), a, metrics(run_dir))
