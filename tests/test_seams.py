"""Where two features meet (issue #44): a rollback and the evaluation state keyed by the weights' hash (class 3), and
a tracker that goes away, or never answers, around a run (class 9). No Ray."""

from __future__ import annotations

import json
import shutil

import torch

from minilm import checkpoint as C
from minilm.config import TrainConfig
from minilm.eval_log import EvalInbox, scored_keys


def mark(run, step: int, sha: str) -> str:
    """A checkpoint folder whose marker vouches for weights `sha` (complete as far as the evaluation state looks)."""
    name = f"checkpoint_{step:08d}"
    (run / name).mkdir(parents=True)
    (run / name / C.MARKER).write_text(json.dumps({"files": {"model.safetensors": sha}}))
    return name


def score(run, step: int, sha: str | None, bpb: float) -> None:
    record = {"task": "held", "kind": "bpb", "step": step, "fingerprint": "fp-held", "checkpoint":
              str(run / f"checkpoint_{step:08d}"), "metrics": {"bpb": bpb}, **({"weights_sha256": sha} if sha else {})}
    with open(run / "eval.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


# ---- class 3: after a rollback, an abandoned branch's scores are nobody's ------------------------------------

def test_after_a_rollback_the_abandoned_branchs_scores_are_never_the_new_runs(tmp_path):
    """Branch A scored its checkpoint 8 (weights a8), and was the best; the run rolled back to 4 (--resume 4
    --abandon-newer: A's 8 moved aside, eval.jsonl, best.json and eval-pending.json kept). The new run's own 8 (b8)
    is unscored for pruning and pins, A's score is never forwarded as its own, and the new run's score is."""
    run = tmp_path / "run"
    folder = C.RunFolder(run)
    mark(run, 4, "w4")
    score(run, 4, "w4", 3.0)
    mark(run, 8, "a8")
    C.write_pending(folder, ["checkpoint_00000008"])  # an evaluator (since gone) had queued A's 8 once more
    score(run, 8, "a8", 1.0)
    assert C.update_best(folder, "held/bpb", "checkpoint_00000008", 8, 1.0, "a8")
    shutil.rmtree(run / "checkpoint_00000008")  # the rollback's move aside
    inbox = EvalInbox(run, ["held"], [{"optimizer_step": 4, "eval_task": "held", "weights_sha256": "w4"}],
                      weights=lambda: C.held_weights(folder))
    assert inbox.poll(6) == []
    mark(run, 8, "b8")  # the new run's checkpoint of the same step
    assert inbox.poll(8) == [] and not inbox.scored([8])  # A's score is not the new run's, nor scores its 8
    assert C.scored_checkpoints(folder) == {"checkpoint_00000004"} and C.pinned(folder) == set()
    manager = C.CheckpointManager(C.LocalStorage(run), TrainConfig(), rank=0, device=torch.device("cpu"), keep=1,
                                  keep_unscored=True)
    mark(run, 12, "b12")
    assert manager.prune("checkpoint_00000012") == ["checkpoint_00000004"]  # the new 8 waits for its scores
    score(run, 8, "b8", 2.0)
    assert inbox.poll(8) == [{"optimizer_step": 8, "eval_task": "held", "weights_sha256": "b8", "eval/held/bpb": 2.0}]
    assert inbox.scored([8]) and inbox.latest == {"eval/held/bpb": 2.0}
    assert C.scored_checkpoints(folder) == {"checkpoint_00000008"}
    # A's better best no longer holds: the new run's worse score replaces it
    assert C.update_best(folder, "held/bpb", "checkpoint_00000008", 8, 2.0, "b8")
    C.write_pending(folder, [], scored=("checkpoint_00000008",))
    assert json.loads((run / C.PENDING).read_text())["owners"] == {}  # A's stale entry left with the new 8's score


def test_an_older_eval_log_without_weights_is_read_and_matched_to_nothing(tmp_path):
    run = tmp_path / "run"
    mark(run, 4, "w4")
    score(run, 4, None, 3.0)  # an older minilm's record
    (run / C.PENDING).write_text(json.dumps({"checkpoints": ["checkpoint_00000004"]}))  # and pending list
    assert scored_keys(run / "eval.jsonl") == {(4, None, "fp-held")}  # read, not refused: scored again
    folder = C.RunFolder(run)
    assert C.scored_checkpoints(folder) == set() and C.pinned(folder) == {"checkpoint_00000004"}
    inbox = EvalInbox(run, ["held"], [], weights=lambda: C.held_weights(folder))
    assert inbox.poll(8) == [] and not inbox.scored([4])


# ---- small gaps ----------------------------------------------------------------------------------------------

def test_the_eval_resources_default_is_one_cpu_as_documented():
    from ray_jobs.cli import RayOptions

    first, second = RayOptions(), RayOptions()
    assert first.eval_resources == {"CPU": 1.0} and first.eval_resources is not second.eval_resources


def test_messages_and_cluster_manifests_name_run_dir_not_the_old_flags():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = ["minilm/checkpoint/resume.py", "minilm/trackers.py", "minilm/tracker_backends.py", "ray_jobs/elastic.py",
             *(str(p.relative_to(root)) for p in (root / "cluster").glob("*.yaml"))]
    for name in files:
        text = (root / name).read_text()
        assert "--storage-path" not in text and "another --name" not in text and "--name minilm" not in text, name


# ---- class 9: a tracker that goes away, or never answers ---------------------------------------------------

class Flaky:
    """A tracker backend that raises while `down` (the server gone), and records what reaches it."""

    kind, high_water, new_run = "mlflow", -1, True

    def __init__(self):
        self.down, self.points, self.tries = False, [], 0

    def write(self, scalars, step):
        self.tries += 1
        if self.down:
            raise ConnectionError("Connection refused")
        self.points.append(step)

    write_eval = write

    def state(self):
        return {"run_id": "r1"}

    def close(self, outcome):
        pass


def test_a_tracker_that_goes_away_mid_run_is_tried_once_a_minute_and_caught_up_or_its_gap_said(monkeypatch):
    from minilm import trackers as T

    clock = [1000.0]
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    said, backend = [], Flaky()
    trackers = T.Trackers([backend], say=said.append)
    trackers.log({"loss": 1.0}, 1)
    backend.down = True
    for step in range(2, 40):  # every step of a minute: one try, one warning, training goes on
        trackers.log({"loss": 1.0}, step)
    trackers.log_eval({"eval/held/bpb": 2.0}, 8)
    assert backend.tries == 2 and len(said) == 1 and said[0].startswith("warning: mlflow could not log step 2: "
                                                                        "ConnectionError: Connection refused")
    clock[0] += T.RETRY_S  # tried again, still down: no new line
    trackers.log({"loss": 1.0}, 40)
    assert backend.tries == 3 and len(said) == 1
    backend.down, clock[0] = False, clock[0] + T.RETRY_S  # it is back: caught up in order, the score at its step
    trackers.log({"loss": 1.0}, 41)
    assert backend.points == list(range(1, 40)) + [8, 40, 41] and backend.high_water == 41
    assert said[1] == "note: mlflow answers again: caught up what it missed"
    # away again, past the backlog: the gap is said when it returns
    monkeypatch.setattr(T, "BACKLOG", 5)
    backend.down = True
    for step in range(42, 52):
        trackers.log({"loss": 1.0}, step)
    backend.down, clock[0] = False, clock[0] + T.RETRY_S
    trackers.log({"loss": 1.0}, 52)
    assert backend.points[-5:] == [48, 49, 50, 51, 52]
    assert said[-1] == ("note: mlflow answers again: caught up what it missed; 6 write(s) of steps 42-47 are not in "
                        "it (metrics.jsonl has them)")
    backend.down = True  # still away at the end: tried once more, and the gap said
    trackers.log({"loss": 1.0}, 53)
    trackers.close()
    assert said[-1] == "note: mlflow is still away at the end: 1 write(s) of steps 53-53 are not in it (metrics.jsonl " \
                       "has them)"


def test_an_mlflow_server_that_accepts_and_never_answers_is_refused_in_seconds():
    import socket
    import time

    from minilm import trackers as T

    with socket.create_server(("127.0.0.1", 0)) as server:  # the kernel accepts; nobody ever answers
        port, t0 = server.getsockname()[1], time.monotonic()
        try:
            T.check_trackers(["mlflow"], {"mlflow_uri": f"http://u:pw@127.0.0.1:{port}"}, run_dir=None)
            raise AssertionError("not refused")
        except T.TrackerError as e:
            assert str(e).startswith(f"--mlflow-uri http://***@127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} "
                                     f"within {T.REACH_TIMEOUT_S:g} s")
    assert time.monotonic() - t0 < T.REACH_TIMEOUT_S + 2


def test_a_sigterm_during_the_starts_tracker_wait_ends_the_process_at_once(tmp_path):
    """The interleaving is the server's: SIGTERM is sent once the start's request to it has arrived."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        proc = subprocess.Popen([sys.executable, "-m", "minilm.train", "--tracker", "mlflow", "--mlflow-uri",
                                 f"http://127.0.0.1:{server.getsockname()[1]}", "--run-dir", str(tmp_path / "run"), "--random-tokens", "65536"],
                                cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        conn, _ = server.accept()  # the start waits on this server's answer now
        conn.recv(1024)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        conn.close()
    assert proc.returncode == 130 and time.monotonic() - t0 < 3
    assert err.strip().splitlines() == ["error: interrupted"], err
    assert not (tmp_path / "run").exists()  # nothing half-written, nor a lease left behind
