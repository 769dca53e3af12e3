"""Nothing a user saved is lost, whichever command runs (minilm.checkpoint: one owner for checkpoints and resume).

Each test is a scenario of issue #32 and the rule it breaks: an export over a folder of other files; a resume from an
older checkpoint, or `--resume never`, over newer ones; two live runs in one folder; remote storage; staging left by
a crash; fsync before pruning; foreign markers; the stop options after a resume. `minilm.train` runs in this process
(`main`), `ray_jobs.pretrain`'s driver through its `main` on the session's Ray (refused before any worker starts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import bitwise_equal, metrics, sigterm_kept, tree
from inprocess import checkpoint_weights, configs, run_local, torchrun, train_flags
from runs import tiny_args

from minilm import checkpoint as C
from minilm import data as D
from minilm import train
from minilm.distributed import AGREEMENT_DELAY
from minilm.fsio import STAGING, staging_dir
from minilm.train import LocalLauncher
from minilm.trainer import Dataset, RunOptions, Trainer
from ray_jobs import export, pretrain

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cli(capsys):
    """`python -m minilm.train FLAGS` in this process: (exit code, stdout, stderr); the SIGTERM handler restored."""
    def run(*flags):
        code = train.main([str(f) for f in flags])
        out = capsys.readouterr()
        return code, out.out, out.err

    with sigterm_kept():
        yield run


def checkpoints(run_dir: Path) -> list[str]:
    return C.RunFolder(run_dir).checkpoints()


# ---- 1. an export writes only into a new or empty folder, or over an earlier export --------------------------------

def test_export_refuses_a_folder_of_other_files_untouched_and_replaces_only_its_own(run_data, tmp_path, capsys,
                                                                                      monkeypatch):
    run_dir = tmp_path / "run1"
    run_local(run_data, run_dir, max_steps=8)
    ckpt = run_dir / "checkpoint_00000008"
    models = tmp_path / "models"
    models.mkdir()
    (models / "other-model.safetensors").write_bytes(b"someone's model")
    monkeypatch.chdir(models)
    for output in (run_dir, models, "."):  # the run's own folder, a folder of other models, the working directory
        before = tree(tmp_path)
        code = export.main(["--checkpoint", str(ckpt), "--output", str(output)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "holds other files" in err, err
        assert tree(tmp_path) == before
    out = tmp_path / "out"
    for _ in range(2):  # a new folder, then over that export
        assert export.main(["--checkpoint", str(ckpt), "--output", str(out), "--format", "minimind"]) == 0
    files = json.loads((out / C.MARKER).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in out.iterdir() if p.name != C.MARKER)  # the .pth is in the marker
    assert "pretrain_64.pth" in files
    C.verify(out)
    (out / "pretrain_64.pth").write_bytes(b"changed")
    with pytest.raises(C.CheckpointError, match="pretrain_64.pth does not match"):
        C.verify(out)


# ---- 2. a resume never mixes two branches ---------------------------------------------------------------------------

def test_resume_never_or_from_an_older_checkpoint_is_refused_naming_the_newer_ones(run_data, tmp_path, cli):
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, max_steps=12)
    flags = train_flags(run_data, run_dir, max_steps=12)
    before = tree(run_dir)
    code, _, err = cli(*flags, "--resume", "never")
    assert code == 2 and err.count("\n") == 1 and "checkpoint_00000004, checkpoint_00000008, checkpoint_00000012" \
        in err and "--abandon-newer" in err, err
    code, _, err = cli(*flags, "--resume", run_dir / "checkpoint_00000004")
    assert code == 2 and "checkpoint_00000008, checkpoint_00000012" in err and "checkpoint_00000004," not in err, err
    code, _, err = cli(*flags, "--abandon-newer")  # with --resume auto there is nothing to abandon: not a silent no-op
    assert code == 2 and err == "error: --abandon-newer goes with --resume never or --resume PATH (an older " \
        "checkpoint), not auto\n", err
    assert tree(run_dir) == before  # metrics.jsonl too


def test_a_rollback_with_abandon_newer_moves_the_newer_checkpoints_aside_and_auto_never_picks_them(
        run_data, tmp_path, cli):
    """Back to checkpoint 8 of a finished run with --keep-checkpoints 1: 12, 16, 20 (and a copy of the logs) move into
    abandoned-<time>/; the new branch's checkpoints are not pruned away as written, the origin stays, and the run ends
    with the uninterrupted run's weights. --resume auto afterwards continues the new branch."""
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, keep_checkpoints=5)
    uninterrupted = checkpoint_weights(run_dir)
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    flags = train_flags(run_data, run_dir) + ["--keep-checkpoints", "1"]
    code, out, err = cli(*flags, "--resume", run_dir / "checkpoint_00000008", "--abandon-newer")
    assert code == 0, err
    abandoned = [p for p in run_dir.iterdir() if p.name.startswith("abandoned-")]
    assert len(abandoned) == 1 and f"moved checkpoint_00000012, checkpoint_00000016, checkpoint_00000020 into " \
        f"{abandoned[0]}" in out
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["checkpoint_00000012", "checkpoint_00000016",
                                                             "checkpoint_00000020", "last_optimizer_step",
                                                             "metrics.jsonl", "world_size.csv"]
    assert (abandoned[0] / "metrics.jsonl").read_text() == old_metrics  # the abandoned branch's log, whole
    assert checkpoints(run_dir) == ["checkpoint_00000008", "checkpoint_00000020"]  # the origin is never pruned
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted)
    code, out, _ = cli(*flags)
    assert code == 0 and "resumed run run at optimizer step 20 " in out  # the new branch's last


def test_resume_never_with_abandon_newer_starts_fresh_and_keeps_the_old_run_aside(run_data, tmp_path, cli):
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, max_steps=8)
    code, out, _ = cli(*train_flags(run_data, run_dir, max_steps=4), "--resume", "never", "--abandon-newer")
    assert code == 0 and "starting run run fresh" in out
    abandoned = next(p for p in run_dir.iterdir() if p.name.startswith("abandoned-"))
    assert {"checkpoint_00000004", "checkpoint_00000008", "metrics.jsonl"} <= {p.name for p in abandoned.iterdir()}
    assert [r["optimizer_step"] for r in metrics(run_dir)] == [4] and checkpoints(run_dir) == ["checkpoint_00000004"]


@pytest.mark.ray
def test_the_ray_driver_follows_the_same_rules(ray_address, run_data, tmp_path, capsys):
    storage = tmp_path / "runs"
    run_local(run_data, storage / "r", max_steps=8)
    before = tree(storage)
    for resume in ("never", str(storage / "r" / "checkpoint_00000004")):
        code = pretrain.main(tiny_args(run_data, storage, "r", "--resume", resume))
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "checkpoint_00000008" in err and "--abandon-newer" in err, err
    assert tree(storage) == before


# ---- 3. one live run per run folder --------------------------------------------------------------------------------

@pytest.mark.slow  # ~7 s: two training processes
def test_a_second_live_run_in_the_same_folder_is_refused(run_data, tmp_path):
    """Two `minilm.train` processes on one --run-dir: the second gets one line and exit 2 while the first runs (held
    after its first step), and the first finishes untouched."""
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    hold.touch()
    flags = train_flags(run_data, run_dir, max_steps=8)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINILM_TESTING": "1", "MINILM_TEST_HOLD_FILE": str(hold)}
    first = subprocess.Popen([sys.executable, "-m", "minilm.train", *flags], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not Path(f"{hold}.rank0").exists():
            assert first.poll() is None and time.time() < deadline, first.stdout.read()
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "minilm.train", *flags], capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.startswith(f"error: run folder {run_dir} is in use by a live run (pid {first.pid} on ")
        assert second.stderr.count("\n") == 1
        hold.unlink()
        assert first.wait(120) == 0
    finally:
        first.kill()
    assert [r["optimizer_step"] for r in metrics(run_dir)] == [4, 8] and not (run_dir / C.LEASE).exists()
    others = [p for p in run_dir.rglob("*") if p.stat().st_mode & 0o007]  # other users on the shared storage
    assert others == [], others


def test_a_stale_lease_is_taken_over_with_a_note_and_a_live_one_is_not(tmp_path, capsys):
    folder = C.RunFolder(tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for held, taken in (({"host": os.uname().nodename, "pid": gone.pid}, True),  # its process is gone
                            ({"host": "elsewhere", "pid": 1, "heartbeat": time.time() - 120}, True),  # silent 2 min
                            ({"host": "elsewhere", "pid": 1}, False),  # another machine, beating
                            ({"host": os.uname().nodename, "pid": sleeper.pid}, False)):  # alive here
            folder.write(C.LEASE, json.dumps({"heartbeat": time.time(), **held}).encode())
            notes = []
            if taken:
                C.Lease(folder, notes.append).take().release()
                assert len(notes) == 1 and notes[0].startswith(f"note: taking over run folder {folder.display}")
            else:
                with pytest.raises(train.UsageError, match="is in use by a live run"):
                    C.Lease(folder, notes.append).take()
    finally:
        sleeper.kill()


@pytest.mark.ray
def test_the_ray_driver_refuses_a_run_folder_in_use(ray_address, run_data, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "busy"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        C.RunFolder(run_dir).write(C.LEASE, json.dumps({"host": os.uname().nodename, "pid": sleeper.pid,
                                                        "heartbeat": time.time()}).encode())
        assert pretrain.main(tiny_args(run_data, tmp_path / "runs", "busy")) == 2
        assert f"error: run folder {run_dir} is in use by a live run (pid {sleeper.pid}" in capsys.readouterr().err
    finally:
        sleeper.kill()


# ---- 4. remote storage: the same rules ------------------------------------------------------------------------------

@pytest.mark.ray
def test_resume_never_and_an_older_path_are_honoured_on_s3(ray_address, run_data, tmp_path, capsys):
    """A run folder in a bucket (moto's S3 server) holding checkpoints 4 and 8: --resume never and --resume of a local
    checkpoint are refused by the driver, as for a local folder; with --abandon-newer they move aside in the bucket."""
    import pyarrow.fs as pafs
    from s3_server import S3Server

    local = tmp_path / "local"
    run_local(run_data, local, max_steps=8)
    server = S3Server().start()
    try:
        fs = server.filesystem()
        fs.create_dir("bucket/runs/r")
        for name in ("checkpoint_00000004", "checkpoint_00000008"):
            pafs.copy_files(str(local / name), f"bucket/runs/r/{name}", pafs.LocalFileSystem(), fs)
        storage = server.uri("bucket/runs")
        folder = C.RunFolder(f"{storage.split('?')[0]}/r?{storage.split('?')[1]}")
        assert folder.newest_complete() == "checkpoint_00000008" and folder.local is None
        for resume in ("never", str(local / "checkpoint_00000004")):
            code = pretrain.main(tiny_args(run_data, storage, "r", "--resume", resume, "--max-steps", "4"))
            err = capsys.readouterr().err
            assert code == 2 and "checkpoint_00000008" in err and "--abandon-newer" in err, err
        plan = pretrain.plan_run(pretrain.build_parser().parse_args(
            tiny_args(run_data, storage, "r", "--resume", "never", "--abandon-newer", "--max-steps", "4")))
        plan.release()
        assert folder.checkpoints() == [] and plan.opts.resume_path is None
        abandoned = [n for n in folder.names() if n.startswith("abandoned-")]
        assert len(abandoned) == 1 and C.RunFolder(f"{folder.display}/{abandoned[0]}", fs).checkpoints() == \
            ["checkpoint_00000004", "checkpoint_00000008"]
        assert "minilm-secret" not in capsys.readouterr().out  # the storage's credentials are not printed
    finally:
        server.stop()


# ---- 5. staging left by a crash is swept -----------------------------------------------------------------------------

def test_staging_left_by_a_dead_process_is_swept_at_the_next_start_and_a_live_ones_is_not(run_data, tmp_path, cli):
    run_dir = tmp_path / "run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = staging_dir(run_dir, "00000008", gone.pid)
    live = staging_dir(run_dir, "00000012")  # this process's
    other = run_dir / f"{STAGING}elsewhere-{gone.pid}-00000008"  # another host's: not ours to judge
    for folder in (dead, live, other):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"0" * 1000)
    code, out, _ = cli(*train_flags(run_data, run_dir, max_steps=4))
    assert code == 0 and f"note: removed {dead.name}, a checkpoint left half-written" in out
    assert not dead.exists() and live.exists() and other.exists()


# ---- 6. a checkpoint is durable before an older one is deleted ------------------------------------------------------

def test_every_file_is_fsynced_before_an_older_checkpoint_is_pruned(run_data, tmp_path, monkeypatch):
    events = []
    real_fsync, real_rmtree = os.fsync, C.resume.shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(C.resume.shutil, "rmtree", lambda p, *a, **k: events.append(("delete", str(p)))
                        or real_rmtree(p, *a, **k))
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, keep_checkpoints=1, max_steps=12)
    deletes = [i for i, (what, _) in enumerate(events) if what == "delete"]
    assert [Path(events[i][1]).name for i in deletes] == ["checkpoint_00000004", "checkpoint_00000008"]
    for i, newer in zip(deletes, ("checkpoint_00000008", "checkpoint_00000012"), strict=True):
        synced = {path for what, path in events[:i] if what == "fsync"}
        folder = run_dir / newer
        assert {str(p) for p in folder.rglob("*")} | {str(folder), str(run_dir)} <= synced, newer


# ---- 7. a foreign or hand-edited marker is "not complete", never a traceback ---------------------------------------

@pytest.mark.parametrize("marker", ["[]", '{"files": []}', '{"files": {}}', '{"files": {"../model.safetensors": "0"}}',
                                    '{"files": {"state.json": "0"}}', "{", "unreadable"])
def test_a_foreign_marker_is_not_complete_and_the_run_continues_the_previous_checkpoint(
        run_data, tmp_path, monkeypatch, marker):
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, max_steps=8)
    path = run_dir / "checkpoint_00000008" / C.MARKER
    if marker == "unreadable":
        real = Path.read_bytes
        monkeypatch.setattr(Path, "read_bytes", lambda p: (_ for _ in ()).throw(PermissionError(13, "Permission "
                            "denied")) if p == path else real(p))
    else:
        path.write_text(marker)
    trainer, outcome, lines = run_local(run_data, run_dir, max_steps=8)
    skipped = [line for line in lines if line.startswith("skipping checkpoint: ")]
    assert len(skipped) == 1 and "checkpoint_00000008" in skipped[0] and "\n" not in skipped[0], lines
    assert any("resumed run run at optimizer step 4 " in line for line in lines)


# ---- 8. the stop options do what they say after a resume and a restart ----------------------------------------------

def test_exit_after_steps_fires_at_the_first_step_past_it_and_the_time_limit_counts_from_the_start(run_data, tmp_path):
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, exit_after_steps=10)
    trainer, outcome, _ = run_local(run_data, run_dir, exit_after_steps=6)  # resumed at 10, already past 6
    assert outcome == "exited" and trainer.step == 11
    model_cfg, train_cfg = configs()
    data = Dataset.prepared(D.open_prepared(run_data))
    run = RunOptions(name="t", run_dir=str(tmp_path / "t"), exit_after_minutes=1.0, started_at=time.time() - 120)
    (tmp_path / "t").mkdir()
    trainer = Trainer(model_cfg, train_cfg, run, data, LocalLauncher(data, 4, run_dir=tmp_path / "t", say=print))
    assert trainer.fit() == "exited" and trainer.step <= 1 + AGREEMENT_DELAY  # a restart 2 minutes in: no minute left


def test_torchrun_ranks_wait_for_rank_0s_refusal(run_data, tmp_path):
    """Under torchrun only rank 0 takes the lease and applies --resume; a refusal there is one line and exit 2 on every
    rank, never a rank left waiting in a collective."""
    run_dir = tmp_path / "run"
    run_local(run_data, run_dir, max_steps=8)
    proc = torchrun(2, train_flags(run_data, run_dir) + ["--resume", "never"], check=False, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("error: run folder") == 1 and "--abandon-newer" in proc.stderr
