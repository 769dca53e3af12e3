"""The training loop's logic without Ray (`minilm.trainer.Trainer` in this process, `minilm.train` under torchrun),
checked against the independent replay of tests/reference.py: resume at the same and at another world size,
resume by path, corrupt checkpoints, a full disk, non-finite steps, SIGTERM, a kill mid-write, MoE.

Ray's own mechanisms (its checkpoint registry, worker restarts, drains, elastic resizes) are in
test_pretrain.py, tests/faults/ and test_elastic.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import run_env
from helpers import ROOT, bitwise_equal, free_port, max_rel_diff, metrics, wait_for
from inprocess import STEPS, checkpoint_weights, configs, run_local, torchrun, train_flags
from reference import check_run, replay

from minilm import checkpoint as C
from minilm.distributed import AGREEMENT_DELAY
from minilm.step import NonFiniteLossError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def uninterrupted(run_data, tmp_path_factory):
    """The in-process run every test here compares with, and its replay."""
    run_dir, ids = tmp_path_factory.mktemp("local") / "uninterrupted", tmp_path_factory.mktemp("ids")
    trainer, outcome, lines = run_local(run_data, run_dir, record=ids)
    model_cfg, train_cfg = configs()
    ref = replay(model_cfg, train_cfg, run_data, ids, STEPS, fused=True)
    minimind = replay(model_cfg, train_cfg, run_data, ids, STEPS)
    return {"run_dir": run_dir, "weights": checkpoint_weights(run_dir), "ref": ref, "minimind": minimind,
            "outcome": outcome, "lines": lines}


@pytest.mark.slow
def test_an_uninterrupted_run_is_the_reference_replay(uninterrupted):
    assert uninterrupted["outcome"] == "finished"
    records = metrics(uninterrupted["run_dir"])
    assert [r["optimizer_step"] for r in records] == [4, 8, 12, 16, 20]
    # one process, the same micro-batches in the same order, torch's fused AdamW kernel: the replay bit for bit
    check_run(uninterrupted["ref"], uninterrupted["weights"], records, rtol_weights=0, rtol_loss=0, rtol_grad_norm=0)
    assert bitwise_equal(uninterrupted["weights"], uninterrupted["ref"].weights)
    # MiniMind's for-loop AdamW rounds some elements of the same update differently: close to the run, not equal
    check_run(uninterrupted["minimind"], uninterrupted["weights"], records, rtol_weights=1e-5, rtol_loss=1e-6,
              rtol_grad_norm=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]
    assert "starting run uninterrupted fresh: 20 optimizer steps" in uninterrupted["lines"][0]
    assert ", GQA sdpa, " in uninterrupted["lines"][0]  # the GQA path, named (untimed on CPU: SDPA's enable_gqa)


@pytest.mark.slow
def test_exit_after_steps_then_resume_is_bitwise_equal(run_data, tmp_path, uninterrupted):
    run_dir, ids = tmp_path / "split", tmp_path / "ids"
    _, outcome, _ = run_local(run_data, run_dir, record=ids, exit_after_steps=8)
    assert outcome == "exited" and (run_dir / "checkpoint_00000008" / "COMPLETE.json").is_file()
    _, outcome, lines = run_local(run_data, run_dir, record=ids)
    assert outcome == "finished"
    assert any("resumed run split at optimizer step 8 (epoch 0, 128 samples)" in line for line in lines)
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])
    check_run(replay(*configs(), run_data, ids, STEPS, fused=True), checkpoint_weights(run_dir), metrics(run_dir),
              rtol_weights=0, rtol_loss=0, rtol_grad_norm=0)
    steps = [r["optimizer_step"] for r in metrics(run_dir)]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_under_torchrun(run_data, tmp_path, uninterrupted, before, after):
    """Plain DDP (torchrun, gloo) stopped at step 6 and continued at another world size: the same samples at
    every step, and the replay's weights and losses (within the reduction-order difference)."""
    run_dir, ids = tmp_path / "ws", tmp_path / "ids"
    env = {"MINILM_TEST_RECORD_SAMPLE_IDS": str(ids)}
    ids.mkdir()
    torchrun(before, train_flags(run_data, run_dir) + ["--exit-after-steps", "6"], **env)
    second = torchrun(after, train_flags(run_data, run_dir), **env)
    acc = {1: 4, 2: 2}
    assert (f"resumed run ws at optimizer step 6 (epoch 0, 96 samples): world size {before} -> {after}, "
            f"accumulation {acc[before]} -> {acc[after]}") in second.stdout
    check_run(replay(*configs(), run_data, ids, STEPS), checkpoint_weights(run_dir), metrics(run_dir))
    # each within 1e-5 of the replay (the uninterrupted run: test_an_uninterrupted_run_is_the_reference_replay)
    assert max_rel_diff(checkpoint_weights(run_dir), uninterrupted["weights"]) < 2e-5


AT_FINALIZATION = """
import atexit, os
if os.environ.get("RANK") is not None:  # a torchrun rank, not the launcher
    def record():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        with open(os.path.join(os.environ["FINALIZED_DIR"], "rank" + os.environ["RANK"]), "w") as f:
            f.write(" ".join(sorted(names)))
    atexit.register(record)
"""


@pytest.mark.slow
def test_a_torchrun_rank_never_finalizes_the_interpreter_with_gloos_threads_alive(run_data, tmp_path):
    """A gloo thread that drops a finished collective's tensors while the interpreter finalizes aborts the rank
    (SIGABRT, "terminate called without an active exception": 2 of 20 torchrun runs here, and CI once), and
    gloo's threads can outlive destroy_process_group. An atexit hook (a sitecustomize on PYTHONPATH) records
    the threads of each rank that reaches interpreter finalization: none may have gloo's threads then."""
    site, finalized = tmp_path / "site", tmp_path / "finalized"
    site.mkdir()
    finalized.mkdir()
    (site / "sitecustomize.py").write_text(AT_FINALIZATION)
    flags = train_flags(run_data, tmp_path / "run") + ["--exit-after-steps", "4"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "-m", "minilm.train", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env=run_env(None, OMP_NUM_THREADS="1", PYTHONPATH=f"{site}:{ROOT}",
                                                   FINALIZED_DIR=str(finalized)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: exited at optimizer step 4/20" in proc.stdout  # rank 0's last line, flushed before it left
    records = {p.name: p.read_text() for p in finalized.iterdir()}
    assert not [rank for rank, threads in records.items() if "gloo" in threads], records


@pytest.mark.slow
def test_resume_from_a_path(run_data, tmp_path, uninterrupted):
    start = uninterrupted["run_dir"] / "checkpoint_00000012"
    if not start.exists():  # kept: the last 3 (12, 16, 20)
        pytest.fail(f"{start} was pruned")
    run_dir = tmp_path / "frompath"
    _, _, lines = run_local(run_data, run_dir, resume=str(start))
    assert any("resumed run frompath at optimizer step 12" in line for line in lines)
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])


@pytest.mark.slow
def test_truncated_and_bit_flipped_checkpoints_are_skipped(run_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "corrupt"
    run_local(run_data, run_dir, exit_after_steps=12)
    with open(run_dir / "checkpoint_00000012" / "optimizer.pt", "r+b") as f:  # truncated: a torn write
        f.truncate(100)
    model = run_dir / "checkpoint_00000008" / "model.safetensors"  # one bit flipped: bad storage
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    _, _, lines = run_local(run_data, run_dir)
    text = "\n".join(lines)
    assert "checkpoint_00000012 is corrupt: optimizer.pt does not match its SHA-256" in text
    assert "checkpoint_00000008 is corrupt: model.safetensors does not match its SHA-256" in text
    assert "resumed run corrupt at optimizer step 4 " in text
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_stops_the_run_and_resume_is_bitwise_equal(run_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "diskfull"
    with pytest.raises(C.CheckpointError) as e:
        run_local(run_data, run_dir, hooks={"disk_full_at_step": 8})
    assert str(e.value).startswith("could not write the checkpoint of optimizer step 8 to ")
    assert "(optimizer.pt): no space left on device" in str(e.value) and "--resume auto" in str(e.value)
    assert C.RunFolder(run_dir).newest_complete() == "checkpoint_00000004"
    assert not (run_dir / "checkpoint_00000008").exists()
    _, _, lines = run_local(run_data, run_dir)
    assert any("resumed run diskfull at optimizer step 4 " in line for line in lines)
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])


@pytest.mark.slow
def test_a_nan_step_is_skipped_and_counted(run_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "nan1"
    trainer, outcome, lines = run_local(run_data, run_dir, hooks={"nan_at_steps": (5,)}, max_steps=8)
    records = metrics(run_dir)
    assert outcome == "finished" and records[-1]["optimizer_step"] == 8 and records[-1]["skipped_steps"] == 1
    assert records[0]["skipped_steps"] == 0
    assert any("skipped 1" in line for line in lines)


@pytest.mark.slow
def test_nan_steps_in_a_row_stop_the_run_naming_the_steps(run_data, tmp_path):
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row \(5\.\.7\) had a non-finite loss"):
        run_local(run_data, tmp_path / "nan3", hooks={"nan_at_steps": (5, 6, 7)}, max_nonfinite_steps=3, max_steps=12)
    # stopped at the step every rank agreed on: the trip at step 7, acted on AGREEMENT_DELAY steps later
    stopped_at = 7 + AGREEMENT_DELAY
    assert [r["optimizer_step"] for r in metrics(tmp_path / "nan3")] == [s for s in (4, 8, 12) if s <= stopped_at]


@pytest.mark.slow
def test_moe_reports_aux_loss_and_exports_minimind_weights(run_data, tmp_path):
    run_dir = tmp_path / "moe"
    trainer, _, lines = run_local(run_data, run_dir, use_moe=True, max_steps=8)
    assert any("expert_load" in line for line in lines)
    last = metrics(run_dir)[-1]
    assert last["aux_loss"] > 0 and last["loss"] == pytest.approx(last["lm_loss"] + last["aux_loss"], rel=1e-5)
    out = tmp_path / "export"
    exp = subprocess.run([sys.executable, "-m", "ray_jobs.export", "--checkpoint", str(run_dir / "checkpoint_00000008"),
                          "--output", str(out), "--format", "minimind"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert exp.returncode == 0, exp.stderr
    from minilm.config import ModelConfig
    from minilm.model import MiniMindForCausalLM

    model = MiniMindForCausalLM(ModelConfig(**json.loads((out / "config.json").read_text())))
    state = torch.load(out / "pretrain_64_moe.pth", weights_only=True)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    assert any(k.startswith("model.layers.0.mlp.experts.3.") for k in state)


def start_train(flags: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "minilm.train", *flags], cwd=ROOT,
                            env=run_env(None, OMP_NUM_THREADS="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_agreed_step_and_resume_is_bitwise_equal(run_data, tmp_path, uninterrupted):
    """SIGTERM while the run is held after step 9: every rank checkpoints at step 9 + AGREEMENT_DELAY, exits,
    and the resumed run redoes nothing."""
    run_dir, hold = tmp_path / "sigterm", tmp_path / "hold"
    hold.touch()
    proc = start_train(train_flags(run_data, run_dir), MINILM_TEST_HOLD_FILE=str(hold))
    held = tmp_path / "hold.rank0"
    wait_for(held.is_file, proc, "the run was held", timeout=120)  # held after the first step
    hold.unlink()
    wait_for(lambda: (run_dir / "checkpoint_00000008" / "COMPLETE.json").is_file(), proc, "checkpoint 8", timeout=120)
    held.unlink()
    hold.touch()
    wait_for(held.is_file, proc, "the run was held again", timeout=120)
    step = int(held.read_text())
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    hold.unlink()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out[-3000:]
    expected = step + AGREEMENT_DELAY
    assert f"SIGTERM at optimizer step {expected}: checkpoint written" in out, out[-3000:]
    assert C.RunFolder(run_dir).newest_complete() == f"checkpoint_{expected:08d}"
    _, _, lines = run_local(run_data, run_dir)
    assert any(f"resumed run sigterm at optimizer step {expected} " in line for line in lines)
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_killed_during_a_checkpoint_write_resumes_from_the_previous_one(run_data, tmp_path, uninterrupted, mode):
    """SIGKILL while checkpoint 8 is written (every file there but COMPLETE.json; in async mode by the background
    writer while training goes on to checkpoint 12, which waits for it): the resumed run passes over the partial
    folder, continues checkpoint 4 and ends bitwise equal."""
    run_dir, paused = tmp_path / "killwrite", tmp_path / "paused"
    (tmp_path / "ids").mkdir()
    proc = start_train(train_flags(run_data, run_dir) + ["--checkpoint-mode", mode],
                       MINILM_TEST_CHECKPOINT_DELAY_S="600", MINILM_TEST_CHECKPOINT_DELAY_STEP="8",
                       MINILM_TEST_CHECKPOINT_PAUSED=str(paused), MINILM_TEST_RECORD_SAMPLE_IDS=str(tmp_path / "ids"))
    wait_for(paused.is_file, proc, "the writer of checkpoint 8 paused before its marker", timeout=120)
    partial = run_dir / paused.read_text().split("/")[-1]
    assert all((partial / f).is_file() for f in ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json"))
    if mode == "async":  # the training thread went on to checkpoint 12, and waits there for checkpoint 8
        wait_for(lambda: (tmp_path / "ids" / "rank0.jsonl").is_file() and
                 len((tmp_path / "ids" / "rank0.jsonl").read_text().splitlines()) >= 12, proc, "step 12", timeout=120)
        time.sleep(1.0)
        assert len((tmp_path / "ids" / "rank0.jsonl").read_text().splitlines()) == 12  # held at checkpoint 12
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    torn = run_dir / "checkpoint_00000008"  # a torn copy too: the marker without the files it names
    torn.mkdir()
    shutil.copyfile(run_dir / "checkpoint_00000004" / "COMPLETE.json", torn / "COMPLETE.json")
    _, _, lines = run_local(run_data, run_dir)
    text = "\n".join(lines)
    assert "checkpoint_00000008 is incomplete" in text and "resumed run killwrite at optimizer step 4 " in text
    assert bitwise_equal(checkpoint_weights(run_dir), uninterrupted["weights"])


def test_checkpoint_and_evaluation_time_stay_out_of_the_next_intervals_tokens_per_s(monkeypatch):
    """The meter's interval restarts after a log step's evaluation and checkpoint: 1 s of steps after a 10 s
    checkpoint reports the same tokens/s as 1 s of steps before it."""
    import minilm.progress as P

    clock = [100.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock[0])
    step = 0
    meter = P.Meter(step, total_steps=20, data_wait_s=0.0, mfu=lambda tokens_per_s: tokens_per_s / 1e6)
    for _ in range(4):  # four steps of 512 tokens in one second
        clock[0] += 0.25
        step += 1
        meter.tokens += 512
    first = meter.rates(step, data_wait_s=0.0)
    clock[0] += 10.0  # the checkpoint and validation of this log step
    meter.restart(data_wait_s=0.0)
    for _ in range(4):
        clock[0] += 0.25
        step += 1
        meter.tokens += 512
    second = meter.rates(step, data_wait_s=0.0)
    assert first["tokens_per_s"] == second["tokens_per_s"] == 2048
    assert second["mfu"] == 2048 / 1e6


@pytest.mark.slow
def test_validation_reports_val_loss_and_val_bpb_as_scored_independently(run_data, tmp_path):
    """val_loss and val_bpb of the last step against minilm.bpb.evaluate_documents and the model's own loss, computed
    here on the held-out rows (split_ids) of the final weights."""
    import numpy as np

    from minilm import data as D
    from minilm.bpb import bits_per_byte, evaluate_documents, token_byte_lengths

    trainer, _, lines = run_local(run_data, tmp_path / "val", val_samples=32, max_steps=8)
    last = metrics(tmp_path / "val")[-1]
    assert "val_loss" in last and "val_bpb" in last and f"val_bpb {last['val_bpb']:.4f}" in lines[-1]
    prepared = D.open_prepared(run_data)
    _, val_ids = D.split_ids(prepared.num_sequences, 32)
    rows = torch.from_numpy(D.SequenceStore(prepared).take(val_ids)).long()
    model = trainer.raw_model.eval()
    with torch.no_grad():
        scored = evaluate_documents(model, rows.tolist(), token_byte_lengths(prepared.tokenizer_path), prefix=[],
                                    window=rows.shape[1])  # each row one window
        loss = model(rows, labels=rows).loss
    assert last["val_bpb"] == pytest.approx(bits_per_byte(scored["nats"], scored["bytes"]), rel=1e-5)
    assert last["val_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert np.isfinite(last["val_bpb"]) and last["val_bpb"] > 0


@pytest.mark.slow
def test_a_resumed_muon_run_is_bitwise_equal_and_the_replay(run_data, tmp_path):
    """Muon (block matrices) + AdamW (the rest) as one optimizer, through the Trainer's checkpoint: stopped at 8 and
    resumed, bitwise the uninterrupted run; both the replay's, which builds its optimizer from the same config."""
    straight, split, ids = tmp_path / "straight", tmp_path / "split", tmp_path / "ids"
    run_local(run_data, straight, optimizer="muon", max_steps=12)
    run_local(run_data, split, optimizer="muon", max_steps=12, exit_after_steps=8, record=ids)
    _, _, lines = run_local(run_data, split, optimizer="muon", max_steps=12, record=ids)
    assert any("resumed run split at optimizer step 8" in line for line in lines)
    assert bitwise_equal(checkpoint_weights(split, 12), checkpoint_weights(straight, 12))
    model_cfg, train_cfg = configs(optimizer="muon", max_steps=12)
    check_run(replay(model_cfg, train_cfg, run_data, ids, 12), checkpoint_weights(split, 12), metrics(split))
