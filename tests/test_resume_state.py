"""Resume with real state, in process: dropout, the fp16 GradScaler, a non-finite streak across a checkpoint.

`tests/test_trainer.py` resumes fp32 runs without dropout, where the GradScaler is off and the non-finite guard
is empty at every checkpoint. Here each piece of state a resume restores changes what the run computes:

* dropout 0.1: the masks come from the RNG reseeded at every step from the step (`minilm.trainer`), so a
  resumed run draws the masks the uninterrupted run drew;
* fp16 autocast on CPU (torch supports it; minilm refuses `--dtype fp16` on CPU for users, so the test turns
  it on), with the GradScaler on: a NaN gradient at step 2 halves its scale, and its growth counter runs;
* NaN at steps 7, 8 and 9 with a checkpoint at 8 and a limit of 3 in a row: the guard's count (2 at the
  checkpoint) must survive the resume for the run to stop at step 9.

Resumed == uninterrupted means every piece of the last checkpoint, bit for bit: the weights, the optimizer's
moments, the scaler's state and the guard's counters in state.json. The fp16 run is also the independent
replay's (tests/reference.py, with torch's fused AdamW kernel: bitwise), the one replay-checked run where
unscale-before-clip matters.
"""

from __future__ import annotations

import pytest
import torch
from helpers import metrics
from inprocess import configs, run_local
from reference import check_run, replay

import minilm.trainer as T
from minilm import checkpoint as C
from minilm.step import NonFiniteLossError

pytestmark = pytest.mark.timeout(300)

# fp16 on CPU is emulated and slow: a smaller global batch, 8 steps, a checkpoint every 4
FP16 = dict(dtype="fp16", dropout=0.1, max_steps=8, global_batch_size=4, micro_batch_size=2, checkpoint_every=4)
SCALER_NAN_AT = (2,)  # the scaler sees the NaN gradient as an overflow: it skips the step and halves its scale


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    monkeypatch.setattr("minilm.step.resolve_dtype", lambda name, device: torch.float16 if name == "fp16" else torch.float32)
    # MFU's probe times an fp16 matmul, which a CPU emulates slowly; MFU is not what these runs check
    monkeypatch.setattr(T, "peak_flops", lambda device, dtype: 1e12)


def last_state(run_dir, step: int) -> C.ResumeState:
    return C.load_resume_state(run_dir / f"checkpoint_{step:08d}")


def same_records(records: list[dict]) -> list[dict]:
    """metrics.jsonl without what differs between two runs of one optimisation (clocks, the run's id)."""
    varying = ("tokens_per_s", "mfu", "data_wait_frac", "checkpoint_s", "checkpoint_wait_s", "eta_s", "time",
               "run_id")
    return [{k: v for k, v in r.items() if k not in varying} for r in records]


def assert_same_state(a: C.ResumeState, b: C.ResumeState) -> None:
    """Every component of two checkpoints bit for bit: weights, optimizer, scaler, guard."""
    assert a.model_state.keys() == b.model_state.keys()
    for k in a.model_state:
        assert torch.equal(a.model_state[k], b.model_state[k]), f"weights differ: {k}"
    assert a.optimizer_state["param_groups"] == b.optimizer_state["param_groups"]
    sa, sb = a.optimizer_state["state"], b.optimizer_state["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state differs: parameter {i}, {k}"
    assert a.scaler_state == b.scaler_state, "GradScaler state differs"
    assert a.state["nonfinite_guard"] == b.state["nonfinite_guard"], "non-finite guard state differs"


def test_an_fp16_run_with_dropout_resumed_is_bitwise_the_uninterrupted_run_and_the_replay(run_data, tmp_path,
                                                                                       fp16_on_cpu):
    hooks = {"nan_at_steps": SCALER_NAN_AT}
    straight, split, ids = tmp_path / "straight", tmp_path / "split", tmp_path / "ids"
    run_local(run_data, straight, record=ids, hooks=hooks, **FP16)
    state4 = last_state(straight, 4).scaler_state
    assert state4["scale"] == 2.0 ** 15 and state4["_growth_tracker"] == 2  # not the fresh scaler's 2**16, 0
    run_local(run_data, split, hooks=hooks, exit_after_steps=4, **FP16)
    _, _, lines = run_local(run_data, split, hooks=hooks, **FP16)
    assert any("resumed run split at optimizer step 4" in line for line in lines)
    assert_same_state(last_state(split, 8), last_state(straight, 8))
    assert same_records(metrics(split)) == same_records(metrics(straight))

    ref = replay(*configs(**FP16), run_data, ids, 8, fused=True, nan_at_steps=SCALER_NAN_AT)
    assert ref.scaler_state == last_state(straight, 8).scaler_state
    check_run(ref, last_state(straight, 8).model_state, metrics(straight), rtol_weights=0, rtol_loss=0,
              rtol_grad_norm=0)



def test_a_nonfinite_streak_across_a_checkpoint_trips_after_the_resume(run_data, tmp_path):
    """NaN at 7, 8, 9; limit 3; stopped at 8 (a checkpoint), resumed: the trip at 9, naming 7..9, as without the stop."""
    nan = {"nan_at_steps": (7, 8, 9)}
    kw = dict(max_nonfinite_steps=3, max_steps=12)
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row \(7\.\.9\)") as straight:
        run_local(run_data, tmp_path / "straight", hooks=nan, **kw)
    split = tmp_path / "split"
    _, outcome, _ = run_local(run_data, split, hooks=nan, exit_after_steps=8, **kw)
    assert outcome == "exited"
    assert last_state(split, 8).state["nonfinite_guard"] == {"skipped_total": 2, "in_a_row": 2,
                                                             "first_step_in_a_row": 7}
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row \(7\.\.9\)") as resumed:
        run_local(run_data, split, hooks=nan, **kw)
    assert str(resumed.value) == str(straight.value)
    assert [r["skipped_steps"] for r in metrics(split)] == [r["skipped_steps"] for r in metrics(tmp_path / "straight")]
