"""Fuzzing the files another party could have written into a run folder (issue #44): best.json, eval-pending.json,
lease.json, a checkpoint's marker and state.json, eval.jsonl and task lists. Each is the good document with keys
removed, values swapped for other types, huge numbers, deep nesting, non-UTF-8 bytes, or a symlink where the file
was. Whatever the bytes: the reader's one error line (CheckpointError, UsageError, TaskError), or the documented
recovery (a damaged pending list or lease is none), never another exception. The counts: `pytest -s`."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minilm import checkpoint as C
from minilm.cli import UsageError
from minilm.eval_log import EvalInbox, scored_keys
from minilm.tasks import TaskError, load_tasks

CASES: Counter[str] = Counter()
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SHA = "0" * 64
GOOD = {
    "best": {"checkpoint": "checkpoint_00000004", "step": 4, "metric": "eval/held/bpb", "mode": "min", "value": 1.0,
             "weights_sha256": SHA, "time": "2026-12-04T00:00:00+0000"},
    "pending": {"checkpoints": ["checkpoint_00000004"], "owners": {"h-1": {"checkpoint_00000004": SHA}}},
    "lease": {"host": "elsewhere", "pid": 1, "heartbeat": 1e9, "started": 1e9},
    "marker": {"files": {"model.safetensors": SHA, "state.json": SHA}},
    "state": {"optimizer_step": 4, "world_size": 2, "train_config": {"lr": 1e-3}},
    "record": {"task": "held", "kind": "bpb", "step": 4, "fingerprint": "fp", "weights_sha256": SHA,
               "checkpoint": "checkpoint_00000004", "metrics": {"bpb": 1.0}},
    "tasks": {"tasks": [{"name": "held", "kind": "bpb", "path": "held.jsonl"}]},
}
BAD_VALUES = [None, True, "", "x", "../x", "a/b", -1, 0, 10**30, 2**64, 1e308, [], [1], {}, {"a": [1]}, "\udcff"]
RAW = [b"\xff\xfe\x00", b"{", b"[" * 5000 + b"]" * 5000, b'{"step": ' + b"9" * 5000 + b"}", b"null", b"1e400", b""]


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nseam fuzz cases tried: {dict(CASES)} (total {sum(CASES.values())})")


def mutate(data, doc):
    """`doc` with 1-3 changes at any depth: a key removed, or a value swapped for a bad one."""
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        where, parent = doc, None
        while isinstance(where, (dict, list)) and where and data.draw(st.booleans()):
            parent = where
            where = where[data.draw(st.sampled_from(sorted(where) if isinstance(where, dict) else range(len(where))))]
        target = parent if parent is not None else doc
        if not isinstance(target, (dict, list)) or not target:
            return copy.deepcopy(data.draw(st.sampled_from(BAD_VALUES)))
        key = data.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
        if isinstance(target, dict) and data.draw(st.booleans()):
            target.pop(key)
        else:
            target[key] = copy.deepcopy(data.draw(st.sampled_from(BAD_VALUES)))
    return doc


def hostile_bytes(data, doc) -> bytes | None:
    """The bytes of a damaged copy of `doc`; None: a symlink instead of the file."""
    kind = data.draw(st.sampled_from(["mutated", "mutated", "mutated", "raw", "link"]))
    if kind == "link":
        return None
    if kind == "raw":
        return data.draw(st.sampled_from(RAW))
    return json.dumps(mutate(data, doc)).encode("utf-8", "surrogatepass")


def place(path, raw: bytes | None, tmp) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if raw is None:
        (tmp / "elsewhere").write_text(json.dumps(GOOD["best"]))
        path.symlink_to(tmp / "elsewhere")
    else:
        path.write_bytes(raw)


def one_line(e: BaseException) -> None:
    assert "\n" not in str(e) and str(e), repr(e)[:500]


@FUZZ
@given(data=st.data(), which=st.sampled_from(["best", "pending", "lease", "marker", "state"]))
def test_the_run_folders_json_files_are_read_or_one_line(tmp_path_factory, data, which):
    CASES[which] += 1
    read_or_one_line(tmp_path_factory.mktemp(which), which, hostile_bytes(data, GOOD[which]))


@pytest.mark.parametrize("raw", RAW, ids=range(len(RAW)))
@pytest.mark.parametrize("which", ["best", "pending", "lease", "marker", "state"])
def test_every_raw_damage_of_every_file_is_read_or_one_line(tmp_path, which, raw):
    read_or_one_line(tmp_path, which, raw)  # each RAW case at least once, whatever the fuzzer draws


def read_or_one_line(tmp, which: str, raw: bytes | None) -> None:
    run = tmp / "run"
    (run / "checkpoint_00000004").mkdir(parents=True)
    (run / "checkpoint_00000004" / C.MARKER).write_text(json.dumps(GOOD["marker"]))
    folder = C.RunFolder(run)
    files = {"best": run / C.BEST, "pending": run / C.PENDING, "lease": run / C.LEASE,
             "marker": run / "checkpoint_00000004" / C.MARKER, "state": run / "checkpoint_00000004" / "state.json"}
    if which == "marker":
        files["marker"].unlink()
    place(files[which], raw, tmp)
    try:
        if which == "best":
            C.read_best(folder)
            C.pinned(folder)
            C.resolve(str(run / "best"))
        elif which == "pending":
            assert C.read_pending(folder) <= {"checkpoint_00000004"} | set(C.read_pending(folder))
            C.pinned(folder)
            C.write_pending(folder, ["checkpoint_00000004"])  # the recovery: a damaged list is replaced
            assert C.read_pending(folder) == {"checkpoint_00000004"}
        elif which == "lease":
            held = C.Lease(folder).holder()  # a lease of the wrong shape is none (it is taken over)
            assert held is None or (isinstance(held["host"], str) and type(held["pid"]) is int)
            C.Lease(folder).live()
        elif which == "marker":
            C.weights_sha256(folder, "checkpoint_00000004")
            C.held_weights(folder)
            C.scored_checkpoints(folder)
        else:
            C.files.read_state(run / "checkpoint_00000004", ("optimizer_step", "world_size"))
    except C.CheckpointError as e:
        one_line(e)


@FUZZ
@given(data=st.data())
def test_eval_log_lines_are_scores_or_one_line(tmp_path_factory, data):
    CASES["eval.jsonl"] += 1
    run = tmp_path_factory.mktemp("eval") / "run"
    (run / "checkpoint_00000004").mkdir(parents=True)
    (run / "checkpoint_00000004" / C.MARKER).write_text(json.dumps(GOOD["marker"]))
    lines = [hostile_bytes(data, GOOD["record"]) or b"{}" for _ in range(data.draw(st.integers(1, 3)))]
    (run / "eval.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    folder = C.RunFolder(run)
    inbox = EvalInbox(run, ["held"], [], weights=lambda: C.held_weights(folder))
    for r in inbox.poll(10):
        assert r["weights_sha256"] == SHA and r["optimizer_step"] == 4
    C.scored_checkpoints(folder)
    try:
        scored_keys(run / "eval.jsonl")
    except UsageError as e:
        one_line(e)


@FUZZ
@given(data=st.data())
def test_task_lists_are_tasks_or_one_line(tmp_path_factory, data):
    CASES["tasks"] += 1
    tmp = tmp_path_factory.mktemp("tasks")
    (tmp / "held.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    place(tmp / "tasks.yaml", hostile_bytes(data, GOOD["tasks"]), tmp)
    try:
        load_tasks(tmp / "tasks.yaml")
    except TaskError as e:
        one_line(e)
