"""The run plan (minilm.run): every check before any side effect, for both launchers.

Each refusal that comes late in the start (the config drift of the checkpoint resumed, a missing --data, an unknown
tracker, a bad evaluation task list) is tried with each flag that acts on the run folder (--abandon-newer with
--resume never or an older PATH; pretrain's removal of Ray's checkpoint snapshot): the command is refused in one line
and the run folder is left byte for byte as it was, its lease too.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import sigterm_kept, tree
from inprocess import run_local, train_flags
from runs import tiny_args

from minilm import train
from ray_jobs import pretrain

pytestmark = pytest.mark.timeout(300)

ACTING = {"never": ["--resume", "never", "--abandon-newer"], "older": ["--resume", "{ckpt}", "--abandon-newer"]}
REFUSALS = {  # flag -> (what is refused, a piece of its one line)
    "drift": (["--weight-decay", "0.5"], "cannot resume from"),
    "data": (["--data", "{missing}"], "does not exist"),
    "tracker": (["--tracker", "bogus"], "bogus"),
}


def flags_for(flags: list[str], **values) -> list[str]:
    return [f.format(**values) for f in flags]


@pytest.fixture(scope="module")
def finished(run_data, tmp_path_factory):
    """A local run folder holding checkpoints 4 .. 20 (every one kept)."""
    run_dir = tmp_path_factory.mktemp("plan") / "run"
    run_local(run_data, run_dir, keep_checkpoints=5)
    return run_dir


# a fresh start (--resume never) continues no checkpoint: it has no config to drift from
@pytest.mark.parametrize(("acting", "refusal"), [(a, r) for a in ACTING for r in REFUSALS if (a, r) != ("never", "drift")])
def test_minilm_train_refused_late_leaves_the_run_folder_as_it_was(finished, run_data, tmp_path, capsys, acting,
                                                                   refusal):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = tree(run_dir)
    extra, line = REFUSALS[refusal]
    values = {"ckpt": run_dir / "checkpoint_00000008", "missing": tmp_path / "missing"}
    with sigterm_kept():
        code = train.main([str(f) for f in train_flags(run_data, run_dir) + flags_for(ACTING[acting] + extra,
                                                                                         **values)])
    out = capsys.readouterr()
    assert code == 2 and out.err.count("\n") == 1 and out.err.startswith("error: ") and line in out.err, out.err
    assert "--abandon-newer: moved" not in out.out  # no note of a move that did not happen
    assert tree(run_dir) == before


@pytest.mark.ray
@pytest.mark.parametrize("refusal", ["drift", "tracker", "eval-tasks"])
def test_pretrain_refused_late_leaves_the_run_folder_and_rays_snapshot_as_they_were(ray_address, finished, run_data,
                                                                                   tmp_path, capsys, refusal):
    """The driver's refusals after Ray has started (the resume origin's drift, the eval task list) act on nothing:
    the newer checkpoints stay, and so does Ray Train's checkpoint snapshot, which a start that goes ahead removes."""
    storage = tmp_path / "runs"
    shutil.copytree(finished, storage / "r")
    (storage / "r" / pretrain.RAY_SNAPSHOT).write_text("{}")
    before = tree(storage / "r")
    extra = {"drift": ["--weight-decay", "0.5"], "tracker": ["--tracker", "bogus"],
             "eval-tasks": ["--eval-tasks", str(tmp_path / "missing-tasks.yaml")]}[refusal]
    code = pretrain.main(tiny_args(run_data, storage, "r", "--resume", str(storage / "r" / "checkpoint_00000008"),
                                   "--abandon-newer", "--num-workers", "1", *extra))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert tree(storage / "r") == before


@pytest.mark.parametrize("acting", ["auto", *ACTING])
def test_a_dry_run_of_minilm_train_checks_and_leaves_the_run_folder_as_it_was(finished, run_data, tmp_path, capsys,
                                                                              acting):
    """--dry-run: the resume decision and the checkpoint's configs checked, then nothing written: no lease, no move of
    --abandon-newer, no checkpoint; a refusal is the same one line as without it."""
    from minilm.run import DRY_RUN

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    before = tree(run_dir)
    flags = [str(f) for f in train_flags(run_data, run_dir)] + ["--dry-run"] + flags_for(
        ACTING.get(acting, []), ckpt=run_dir / "checkpoint_00000008")
    with sigterm_kept():
        assert train.main(flags) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[-1] == DRY_RUN and "moved" not in out
        extra, line = REFUSALS["tracker" if acting == "never" else "drift"]  # a fresh start has no drift
        assert train.main([*flags, *extra]) == 2  # refused as ever
    assert line in capsys.readouterr().err
    assert tree(run_dir) == before


def test_a_dry_run_refuses_a_folder_a_live_run_holds_and_makes_no_new_one(run_data, tmp_path, capsys):
    import json
    import os
    import socket
    import time

    from minilm.run import DRY_RUN

    held = tmp_path / "held"
    held.mkdir()
    (held / "lease.json").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(),
                                                 "heartbeat": time.time()}))
    with sigterm_kept():
        assert train.main([*map(str, train_flags(run_data, held)), "--dry-run"]) == 2
        assert "in use by a live run" in capsys.readouterr().err
        new = tmp_path / "new" / "run"
        assert train.main([*map(str, train_flags(run_data, new)), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == DRY_RUN and not (tmp_path / "new").exists()


@pytest.mark.ray
def test_a_dry_run_of_pretrain_leaves_the_run_folder_and_rays_snapshot_as_they_were(ray_address, finished, run_data,
                                                                                    tmp_path, capsys):
    """After the cluster check (Ray joined), a dry run stops: the newer checkpoints stay (--abandon-newer moves
    nothing) and so does Ray Train's snapshot, which a start removes."""
    from minilm.run import DRY_RUN

    storage = tmp_path / "runs"
    shutil.copytree(finished, storage / "r")
    (storage / "r" / pretrain.RAY_SNAPSHOT).write_text("{}")
    before = tree(storage / "r")
    code = pretrain.main(tiny_args(run_data, storage, "r", "--resume", str(storage / "r" / "checkpoint_00000008"),
                                   "--abandon-newer", "--num-workers", "1", "--dry-run"))
    assert code == 0 and capsys.readouterr().out.splitlines()[-1] == DRY_RUN
    assert tree(storage / "r") == before


def test_two_branches_abandoned_within_one_second_are_both_kept(tmp_path, monkeypatch):
    """Two --abandon-newer starts in the same second each get their own abandoned-<time> folder: the second's move
    does not land in (or over) the first's."""
    import time

    from minilm import checkpoint as C

    monkeypatch.setattr(time, "strftime", lambda fmt, *_: "20261204-120000")
    folder = C.RunFolder(tmp_path)
    for branch in ("first", "second"):
        (tmp_path / "checkpoint_00000004").mkdir()
        (tmp_path / "checkpoint_00000004" / "weights").write_text(branch)
        (tmp_path / "metrics.jsonl").write_text(branch)
        folder.move_aside(["checkpoint_00000004", "metrics.jsonl"])
    moved = sorted(p for p in tmp_path.iterdir() if p.name.startswith("abandoned-"))
    assert [p.name for p in moved] == ["abandoned-20261204-120000", "abandoned-20261204-120000-1"]
    assert [(p / "metrics.jsonl").read_text() for p in moved] == ["first", "second"]
    assert [(p / "checkpoint_00000004" / "weights").read_text() for p in moved] == ["first", "second"]


def test_a_fresh_start_moves_the_branchs_evaluation_state_aside_with_it(finished, tmp_path):
    """--resume never --abandon-newer: the scores of the abandoned branch (eval.jsonl, best.json, eval-pending.json)
    go with its checkpoints, so the new run never takes them for its own; decided first, moved only by apply()."""
    from minilm import checkpoint as C

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    for name in ("eval.jsonl", "best.json", "eval-pending.json"):
        (run_dir / name).write_text(f"the old branch's {name}\n")
    folder = C.RunFolder(run_dir)
    before = tree(run_dir)
    decision = C.decide_resume(folder, "never", abandon_newer=True)
    assert tree(run_dir) == before and decision.origin is None
    decision.apply(folder, lambda _: None)
    moved = next(p for p in run_dir.iterdir() if p.name.startswith("abandoned-"))
    for name in ("eval.jsonl", "best.json", "eval-pending.json", "metrics.jsonl"):
        assert not (run_dir / name).exists() and (moved / name).is_file(), name
    assert (moved / "best.json").read_text() == "the old branch's best.json\n" and folder.checkpoints() == []


@pytest.mark.parametrize("lease", ['{"host": "h", "pid": 1, "heartbeat": null}', '{"host": "h", "pid": 1, '
                                   '"heartbeat": "soon"}', '{"host": "h", "pid": 1, "heartbeat": NaN}',
                                   '{"host": ["h"], "pid": 1, "heartbeat": 1}', '{"host": "h", "pid": "1", '
                                   '"heartbeat": 1}', '[1, 2]', '"x"'])
def test_a_lease_of_the_wrong_shape_is_no_lease(tmp_path, lease):
    """lease.json is read as another party wrote it: a null or text heartbeat, a list for a host, text for a pid is
    no live run (taken over at the next start), never a traceback."""
    from minilm import checkpoint as C

    (tmp_path / "lease.json").write_text(lease)
    held = C.Lease(C.RunFolder(tmp_path))
    assert held.holder() is None and not held.live()
    held.take().release()
    assert not (tmp_path / "lease.json").exists()


@pytest.mark.parametrize("pid", [0, -1, 2**40])
def test_a_crafted_pid_is_not_a_live_process(pid):
    from minilm.fsio import pid_alive

    assert pid_alive(pid) is False


def test_an_evaluate_output_file_that_is_not_utf8_is_one_line(tmp_path):
    """`ray_jobs.evaluate --output` naming a file of other bytes: one line naming it and the line, no traceback."""
    from minilm.errors import UsageError
    from minilm.eval_log import scored_keys

    (tmp_path / "out.jsonl").write_bytes(b"\xff\xfe not text\n")
    with pytest.raises(UsageError, match=r"out\.jsonl:1: not a record of ray_jobs\.evaluate \(choose another"):
        scored_keys(tmp_path / "out.jsonl")
