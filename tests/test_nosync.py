"""DDP over two gloo processes (no Ray): optimizer_step all-reduces once per optimizer step, not once
per micro-step, and two workers on halves of the global batch end where one process on all of it does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import leave_process_group
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
           max_position_embeddings=128)
# AdamW moves a near-zero-gradient coordinate by ~lr whatever its size, so reduction-order rounding
# (DDP sums ranks, one process sums micro-batches) shows up as ~lr * 1e-2 there: a small lr keeps it < 1e-6.
WORLD, GLOBAL_BATCH, MICRO, SEQ, STEPS, LR = 2, 8, 2, 16, 2, 5e-5
ACCUMULATION = GLOBAL_BATCH // (MICRO * WORLD)  # 2 micro-steps per optimizer step on each rank


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))


def fresh(use_moe: bool):
    torch.manual_seed(0)
    model = MiniMindForCausalLM(ModelConfig(**CFG, use_moe=use_moe, router_aux_loss_coef=0.01)).train()
    return model, make_optimizer(model, TrainConfig(lr=LR, optimizer="adamw"))


def counting_ddp(model):
    """DDP with a comm hook that records, per all-reduce, which forward pass (micro-step) it belongs to."""
    ddp = DDP(model, bucket_cap_mb=1024)
    state = {"forward": -1, "allreduce_forwards": []}

    def count_forward(module, args):
        state["forward"] += 1

    def hook(st, bucket):
        st["allreduce_forwards"].append(st["forward"])
        return default_hooks.allreduce_hook(None, bucket)

    model.register_forward_pre_hook(count_forward)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = {}
        for use_moe in (False, True):
            model, opt = fresh(use_moe)
            ddp, state = counting_ddp(model)
            scaler = make_grad_scaler(torch.float32, "cpu")
            for step in range(STEPS):
                # Rank r takes the r-th contiguous slice of the global batch, as minilm.data does.
                mine = global_batch(step).chunk(WORLD)[rank]
                optimizer_step(ddp, opt, scaler, list(mine.split(MICRO)), lr=LR, grad_clip=1.0)
            result[use_moe] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                               "allreduce_forwards": list(state["allreduce_forwards"])}

        # Control: the same micro-steps without no_sync all-reduce on every backward.
        model, _ = fresh(False)
        ddp, state = counting_ddp(model)
        for step in range(STEPS):
            for micro in global_batch(step).chunk(WORLD)[rank].split(MICRO):
                (ddp(micro, labels=micro).loss / ACCUMULATION).backward()
        result["control_allreduce_forwards"] = list(state["allreduce_forwards"])
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        leave_process_group()  # not left to interpreter exit: see minilm.distributed


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nosync")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_one_allreduce_per_optimizer_step(ddp_results, use_moe):
    for rank_result in ddp_results:
        forwards = rank_result[use_moe]["allreduce_forwards"]
        # All all-reduces happen in the backward of the last micro-step of each window (forward
        # passes 1 and 3 of 4); the first micro-step of each window ran under no_sync.
        assert sorted(set(forwards)) == [ACCUMULATION * s + ACCUMULATION - 1 for s in range(STEPS)]
        buckets = len(forwards) // STEPS
        assert buckets >= 1 and len(forwards) == STEPS * buckets


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_no_sync_every_micro_step_allreduces(ddp_results):
    for rank_result in ddp_results:
        assert sorted(set(rank_result["control_allreduce_forwards"])) == list(range(STEPS * ACCUMULATION))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
def test_ddp_matches_single_process_on_the_union(ddp_results, use_moe):
    # One process, same global batch (all 8 sequences) as 4 micro-batches of 2: the mean over ranks of
    # each rank's window mean is the mean over all four micro-batches. The MoE aux loss is per
    # micro-batch, and the micro-batches are the same ones, so it matches too.
    model, opt = fresh(use_moe)
    scaler = make_grad_scaler(torch.float32, "cpu")
    for step in range(STEPS):
        optimizer_step(model, opt, scaler, list(global_batch(step).split(MICRO)), lr=LR, grad_clip=1.0)
    reference = model.state_dict()
    initial = fresh(use_moe)[0].state_dict()
    for rank_result in ddp_results:
        params = rank_result[use_moe]["params"]
        assert params.keys() == reference.keys()
        for k in reference:
            torch.testing.assert_close(params[k], reference[k], rtol=0, atol=1e-6, msg=k)
    assert (reference["lm_head.weight"] - initial["lm_head.weight"]).abs().max() > 1e-5  # it trained
