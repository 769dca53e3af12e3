"""Checkpoints across versions and over a run's life: a checkpoint written by an earlier minilm resumes (the
fixtures in tests/fixtures/, one per state.json format; one this version cannot use is one line and exit 2, in
tests/test_bad_config.py), and --keep-checkpoints keeps the newest complete checkpoints (a failed delete is logged,
not fatal)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.make_checkpoint_fixture import CHECKPOINT_STEP, RESUMED_TO, fixture_tokens, train_args
from helpers import metrics, write_marker
from inprocess import checkpoint_weights, run_local
from reference import expected_global_batch
from safetensors.torch import load_file

from minilm import checkpoint as C
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.train import main as train_main
from minilm.train import sequences_from_tokens

FIXTURES = Path(__file__).parent / "fixtures"
FORMATS = sorted(p.name for p in FIXTURES.glob("checkpoint_format*") if p.is_dir())
CHECKPOINT = f"checkpoint_{CHECKPOINT_STEP:08d}"


def test_every_state_format_up_to_todays_has_a_fixture():
    assert FORMATS == [f"checkpoint_format{v}" for v in range(1, C.STATE_FORMAT + 1)]


def resumable_copy(fixture: str, tmp_path: Path) -> tuple[Path, Path]:
    """The fixture's checkpoint in a fresh run folder, and its token ids in a .npy: (run_dir, tokens_file)."""
    run_dir, tokens = tmp_path / "run", tmp_path / "tokens.npy"
    shutil.copytree(FIXTURES / fixture / CHECKPOINT, run_dir / CHECKPOINT)
    np.save(tokens, fixture_tokens())
    return run_dir, tokens


@pytest.mark.parametrize("fixture", FORMATS)
def test_a_checkpoint_of_an_earlier_format_resumes_and_logs_the_losses_of_its_day(fixture, tmp_path, capsys):
    """Resumed with today's code, the fixture logs at every step the lr and the loss that the code which wrote it
    logged after it (logged.json): the lr exactly (a function of the step), the loss within 1e-4 relative (another
    torch or CPU may round the same math differently). The loss of the first resumed step is also computed here
    from the checkpoint's weights alone (a forward pass on that step's rows, by the order contract)."""
    run_dir, tokens = resumable_copy(fixture, tmp_path)
    assert train_main(train_args(tokens, run_dir)) == 0
    out = capsys.readouterr().out
    assert f"resumed run run at optimizer step {CHECKPOINT_STEP} " in out, out
    if fixture == "checkpoint_format1":  # written before --schedule: it goes on with the cosine it ran
        assert f"note: {CHECKPOINT} predates --schedule: the run goes on with its schedule cosine" in out, out
    assert "predates --embedding-lr-ratio" not in out, out  # an AdamW run: the ratio moves nothing there
    assert "with compile" not in out, out  # its `compile: false` is today's off
    logged = {int(k): v for k, v in json.loads((FIXTURES / fixture / "logged.json").read_text()).items()}
    records = {r["optimizer_step"]: r for r in metrics(run_dir)}
    assert sorted(records) == sorted(logged) == list(range(CHECKPOINT_STEP + 1, RESUMED_TO + 1))
    for step, then in logged.items():
        assert records[step]["lr"] == pytest.approx(then["lr"], rel=1e-12), step
        assert records[step]["loss"] == pytest.approx(then["loss"], rel=1e-4), step

    state = json.loads((FIXTURES / fixture / CHECKPOINT / "state.json").read_text())
    model = MiniMindForCausalLM(ModelConfig.from_dict(state["model_config"]))
    model.load_state_dict(load_file(str(FIXTURES / fixture / CHECKPOINT / "model.safetensors")), strict=True)
    rows = sequences_from_tokens(fixture_tokens(), state["train_config"]["seq_len"])
    ids = expected_global_batch(len(rows), 0, state["train_config"]["seed"], state["global_batch_size"],
                                CHECKPOINT_STEP)
    with torch.no_grad():
        first = np.mean([model(mb, labels=mb).loss.item()
                         for mb in rows[ids].split(state["train_config"]["micro_batch_size"])])
    assert records[CHECKPOINT_STEP + 1]["loss"] == pytest.approx(first, rel=1e-5)


def edit_state(checkpoint: Path, edit) -> None:
    """Change state.json and re-hash it: the checkpoint stays complete, only its content is off."""
    state = json.loads((checkpoint / "state.json").read_text())
    edit(state)
    (checkpoint / "state.json").write_text(json.dumps(state))
    write_marker(checkpoint, C.RESUME_FILES)


def test_a_run_begun_with_adamw_is_refused_by_optimizer_muon_with_the_flag_that_continues_it(tmp_path, capsys):
    """These fixtures ran AdamW: resuming one with --optimizer muon is one line that names the flag, exit 2, and the
    checkpoint is left as it was (--optimizer auto, the default, continues it with AdamW)."""
    run_dir, tokens = resumable_copy("checkpoint_format1", tmp_path)
    args = train_args(tokens, run_dir)
    files = lambda: {p: p.read_bytes() for p in sorted((run_dir / CHECKPOINT).rglob("*")) if p.is_file()}  # noqa: E731
    before = files()
    assert train_main(args[:args.index("--optimizer")] + ["--optimizer", "muon"] + args[args.index("--optimizer") + 2:]) == 2
    err = capsys.readouterr().err
    assert "optimizer muon != adamw in the checkpoint" in err and "continue it with --optimizer adamw" in err, err
    assert files() == before and sorted(run_dir.iterdir()) == [run_dir / CHECKPOINT]


def test_a_muon_checkpoint_from_before_embedding_lr_ratio_goes_on_at_the_ratio_it_ran(run_data, tmp_path):
    """Muon checkpoints written before --embedding-lr-ratio moved the embedding at lr (ratio 1.0): resumed with
    today's default ratio, the run says so and goes on at 1.0, bit for bit as an uninterrupted run at 1.0."""
    assert TrainConfig().embedding_lr_ratio != 1.0  # else this resume would prove nothing
    kw = dict(optimizer="muon", max_steps=8)
    whole, _, _ = run_local(run_data, tmp_path / "whole", embedding_lr_ratio=1.0, **kw)
    run_local(run_data, tmp_path / "old", embedding_lr_ratio=1.0, exit_after_steps=4, **kw)
    edit_state(tmp_path / "old" / "checkpoint_00000004", lambda s: s["train_config"].pop("embedding_lr_ratio"))
    resumed, outcome, lines = run_local(run_data, tmp_path / "old", **kw)  # today's default ratio
    assert outcome == "finished"
    assert "note: checkpoint_00000004 predates --embedding-lr-ratio: the run goes on with its embedding_lr_ratio 1.0" \
        in lines, lines
    assert resumed.train_cfg.embedding_lr_ratio == 1.0
    assert [g["lr_ratio"] for g in resumed.optimizer.param_groups] == \
        [g["lr_ratio"] for g in whole.optimizer.param_groups]
    a, b = checkpoint_weights(tmp_path / "whole", 8), checkpoint_weights(tmp_path / "old", 8)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_ray_driver_refuses_such_a_state_json_before_any_worker(tmp_path):
    """ray_jobs.pretrain's driver reads the checkpoint it will resume with the same rule as minilm.train (its main
    turns the CheckpointError into the one line and exit 2, before Ray starts any worker)."""
    run_dir, _ = resumable_copy(FORMATS[-1], tmp_path)
    edit_state(run_dir / CHECKPOINT, lambda s: s.pop("global_batch_size"))
    folder = C.RunFolder(run_dir)
    origin = C.decide_resume(folder, "auto").origin  # the driver's choice, made before Ray starts
    with pytest.raises(C.CheckpointError, match="state.json lacks global_batch_size"):
        C.check_origin(folder, origin, None, None, None, False)


def test_keep_checkpoints_keeps_the_newest_complete_ones_and_a_failed_delete_only_logs(run_data, tmp_path,
                                                                                       monkeypatch):
    """--keep-checkpoints 2 over 16 steps (a checkpoint every 4): checkpoints 12 and 16 are left, and a torn folder
    older than them goes too. Deleting checkpoint 4 fails once (EACCES): the run logs it, goes on, and deletes it
    at the next checkpoint."""
    run_dir = tmp_path / "keep2"
    torn = run_dir / "checkpoint_00000001"  # a leftover without its marker, older than every checkpoint
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"partial")
    real_rmtree, failed = shutil.rmtree, []

    def rmtree(path, *args, **kwargs):
        if Path(path).name == "checkpoint_00000004" and not failed:
            failed.append(path)
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(C.resume.shutil, "rmtree", rmtree)
    _, outcome, lines = run_local(run_data, run_dir, keep_checkpoints=2, max_steps=16)
    assert outcome == "finished" and failed
    assert C.RunFolder(run_dir).checkpoints() == ["checkpoint_00000012", "checkpoint_00000016"]
    warnings = [line for line in lines if line.startswith("warning: could not delete old checkpoint")]
    assert len(warnings) == 1 and "checkpoint_00000004 (--keep-checkpoints 2): Permission denied" in warnings[0]
    assert "the run goes on" in warnings[0]
