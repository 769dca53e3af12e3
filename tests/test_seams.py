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
    assert inbox.poll(8) == [] and not inbox.scored(8)  # A's score is not the new run's, nor scores its 8
    assert C.scored_checkpoints(folder) == {"checkpoint_00000004"} and C.pinned(folder) == set()
    manager = C.CheckpointManager(C.LocalStorage(run), TrainConfig(), rank=0, device=torch.device("cpu"), keep=1,
                                  keep_unscored=True)
    mark(run, 12, "b12")
    assert manager.prune("checkpoint_00000012") == ["checkpoint_00000004"]  # the new 8 waits for its scores
    score(run, 8, "b8", 2.0)
    assert inbox.poll(8) == [{"optimizer_step": 8, "eval_task": "held", "weights_sha256": "b8", "eval/held/bpb": 2.0}]
    assert inbox.scored(8) and inbox.latest == {"eval/held/bpb": 2.0}
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
    assert inbox.poll(8) == [] and not inbox.scored(4)


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
