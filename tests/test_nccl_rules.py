"""The training loop on 2 ranks under a stand-in for NCCL's rules (tests/nccl_standin.py): every collective on the
training device, the same collectives in the same order on every rank, no per-forward buffer broadcast.

Each case runs the real `Trainer` on 2 processes (gloo, like `torchrun`) through logging, validation, a
checkpoint, and a SIGTERM seen by one rank and agreed by both, with a training device for its collectives that is
not the CPU (the stand-in's), so any host tensor reaching a collective is refused, however it was made. The
stand-in also refuses the code this project had before (the stop flags built as a CPU tensor and all-reduced after
every step), which a GPU run would have crashed on at step 1.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from inprocess import configs
from nccl_standin import NcclRules, NcclViolation

from minilm.distributed import leave_process_group

pytestmark = pytest.mark.timeout(300)


def _rank(rank: int, world_size: int, port: int, data_dir: str, out: str, variant: str) -> None:
    from safetensors.torch import save_file

    from minilm import data as D
    from minilm.distributed import Collectives, FlagAgreement
    from minilm.step import NonFiniteGuard
    from minilm.train import LocalLauncher
    from minilm.trainer import Dataset, Preempted, RunOptions, Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    result: dict = {}
    try:
        if variant == "old-stop-flags":  # the loop as it was: stop flags as a CPU tensor, all-reduced every step
            def push(self, step, host_flags, device_flags=()):
                flags = torch.tensor([float(bool(f)) for f in host_flags])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                return [n for n, v in zip(self.names, flags.tolist(), strict=False) if v > 0]
            FlagAgreement.push = push
        if variant == "broadcast-buffers":  # DDP's default: the buffers broadcast from rank 0 before every forward
            init = torch.nn.parallel.DistributedDataParallel.__init__

            def ddp_init(self, *args, **kwargs):
                kwargs.pop("broadcast_buffers", None)
                kwargs.pop("forward_sync_buffers", None)
                init(self, *args, **kwargs)
            torch.nn.parallel.DistributedDataParallel.__init__ = ddp_init

        class SigtermOnRank1(LocalLauncher):
            steps = 0

            def stop_flags(self):
                self.steps += 1
                return self.rank == 1 and self.steps >= 5, False

        model_cfg, train_cfg = configs(max_steps=12, val_samples=16, eval_every=4)
        data = Dataset.prepared(D.open_prepared(data_dir))
        launcher = SigtermOnRank1(data, train_cfg.micro_batch_size, rank=rank, world_size=world_size,
                                  run_dir=Path(out) / "run", say=lambda m: None)
        trainer = Trainer(model_cfg, train_cfg, RunOptions(name="nccl", run_dir=str(Path(out) / "run")), data,
                          launcher)
        with NcclRules() as rules:
            # The loop's collectives and the guard whose flags they agree on move to the stand-in's device, as they
            # are on the GPU of a GPU run; the model and DDP stay on the CPU (gloo).
            trainer.collectives = Collectives(rules.device)
            trainer.guard = NonFiniteGuard(train_cfg.max_nonfinite_steps, rules.device)
            try:
                trainer.fit()
                result["outcome"] = "finished"
            except Preempted as e:
                result["outcome"] = f"preempted: {e}"
            except NcclViolation as e:
                result["outcome"] = f"violation: {e}"
        result.update(calls=rules.calls, buffer_broadcasts=rules.buffer_broadcasts, step=trainer.step)
        save_file({k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()},
                  str(Path(out) / f"weights{rank}.safetensors"))
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        leave_process_group()  # not left to interpreter exit: see minilm.distributed


def run_two_ranks(data_dir: Path, out: Path, variant: str) -> list[dict]:
    out.mkdir(parents=True)
    mp.start_processes(_rank, args=(2, free_port(), str(data_dir), str(out), variant), nprocs=2, join=True,
                       start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def loop_now(run_data, tmp_path_factory):
    """The loop as it is, on 2 ranks under the stand-in: its per-rank results and its folder."""
    out = tmp_path_factory.mktemp("nccl") / "now"
    return run_two_ranks(run_data, out, "new"), out


@pytest.mark.slow
def test_every_collective_is_on_the_training_device_in_the_same_order(loop_now):
    ranks, out = loop_now
    for r in ranks:
        # rank 1 saw SIGTERM after step 5; both ranks agreed on it 2 steps later and checkpointed there
        assert r["outcome"] == "preempted: SIGTERM at optimizer step 7: checkpoint written, exiting for a restart", r
        assert r["buffer_broadcasts"] == 0  # DDP broadcasts no buffer before a forward
    assert ranks[0]["calls"] == ranks[1]["calls"]  # the same collectives, in the same order
    ops = [op for op, _, _ in ranks[0]["calls"]]
    assert ops.count("all_reduce") >= 7 + 2 + 1  # 7 stop-flag rounds, 2 logged-loss means, 1 validation sum
    assert (out / "run" / "checkpoint_00000007" / "COMPLETE.json").is_file()


@pytest.mark.slow
def test_the_stand_in_refuses_the_old_cpu_stop_flags(run_data, tmp_path):
    """What the loop did before: `torch.tensor([...])` (a CPU tensor on a GPU run) all-reduced after every step."""
    ranks = run_two_ranks(run_data, tmp_path / "old", "old-stop-flags")
    for r in ranks:
        assert r["outcome"].startswith("violation: NCCL refuses this all_reduce: a tensor on cpu"), r
        assert r["step"] == 1  # the first step's flags: where the first multi-GPU run would have crashed


@pytest.mark.slow  # ~7 s: two runs of the loop
def test_buffers_not_broadcast_give_the_same_weights(run_data, tmp_path, loop_now):
    """DDP without per-forward buffer syncs (the RoPE tables are computed identically on every rank): bitwise the
    same training as with DDP's default broadcast."""
    from safetensors.torch import load_file

    (ours, out), default = loop_now, run_two_ranks(run_data, tmp_path / "b", "broadcast-buffers")
    assert [r["buffer_broadcasts"] for r in ours] == [0, 0]
    assert [r["buffer_broadcasts"] for r in default] == [7, 7]  # DDP syncs on the forward that all-reduces: once a step
    a, b = load_file(str(out / "weights0.safetensors")), load_file(str(tmp_path / "b" / "weights0.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
