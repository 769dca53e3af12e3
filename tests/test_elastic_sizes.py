"""Elastic at every world size (issue 45): any W from 1 to the global batch B trains the same global batch.

The arithmetic (`minilm.data.rank_micro_batches`) exhaustively over small B, m, W; then the gradient of one
optimizer step at W = 1..5 over gloo (5 spawned processes, a subgroup of the first W for each W) against one
process computing the mean loss over the whole global batch, with a document mask, dense and MoE.
"""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port, max_rel_diff

from minilm import data as D
from minilm.config import ModelConfig, accumulation_steps
from minilm.distributed import leave_process_group
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, optimizer_step
from minilm.tokenizer import BOS_ID, EOS_ID


def test_every_sequence_once_in_order_and_weights_sum_to_one():
    for B in range(1, 14):
        for m in range(1, 7):
            for W in range(1, B + 1):
                layouts = [D.rank_micro_batches(B, m, W, r) for r in range(W)]
                flat = [(a, b) for layout in layouts for a, b, _ in layout]
                # contiguous, in rank order, each sequence exactly once
                assert [i for a, b in flat for i in range(a, b)] == list(range(B)), (B, m, W)
                sizes = [layout[-1][1] - layout[0][0] for layout in layouts]
                assert sizes == sorted(sizes, reverse=True) and set(sizes) <= {B // W, -(-B // W)}, (B, m, W)
                for layout in layouts:  # micro-batches of m, the last one of a rank may be smaller
                    assert all(b - a == m for a, b, _ in layout[:-1]) and 1 <= layout[-1][1] - layout[-1][0] <= m
                    assert all(w == Fraction(b - a, B) for a, b, w in layout)
                assert sum(w for layout in layouts for *_, w in layout) == 1  # exactly
                assert accumulation_steps(B, m, W) == max(len(layout) for layout in layouts)
    with pytest.raises(ValueError):
        D.rank_micro_batches(4, 2, 5, 0)  # a fifth worker would have no sequence


def test_rank_orders_read_each_global_batch_in_order_at_every_size():
    train_ids, G, spe = np.arange(40, dtype=np.int64) * 3, 7, 5
    want = np.concatenate([D.epoch_order(train_ids, 9, e)[:spe * G] for e in range(2)]).reshape(-1, G)
    for W in range(1, G + 1):
        for start in (0, 3, 6):  # a resume at any step, from a checkpoint of any size
            orders = [D.RankOrder(train_ids, 9, spe, G, W, r, start) for r in range(W)]
            steps = 2 * spe - start
            got = [o.sample_ids(np.arange(steps * o.per_rank)).reshape(steps, -1) for o in orders]
            assert (np.concatenate(got, axis=1) == want[start:]).all(), (W, start)


B, M, SEQ, SIZES = 7, 2, 16, (1, 2, 3, 4, 5)
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
           max_position_embeddings=64, document_mask=True, router_aux_loss_coef=0.05)


def global_batch() -> torch.Tensor:
    """B packed rows with document boundaries (BOS, EOS) inside, so the document mask matters."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(3, 256, (B, SEQ + 1), generator=g)
    rows[torch.rand(rows.shape, generator=g) < 0.15] = BOS_ID
    rows[torch.rand(rows.shape, generator=g) < 0.1] = EOS_ID
    return rows


def fresh(use_moe: bool) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    return MiniMindForCausalLM(ModelConfig(**CFG, use_moe=use_moe)).train()


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps the gradients it is given (after the all-reduce and a no-op clip)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=max(SIZES))
    try:
        result = {}
        for W in SIZES:
            group = dist.new_group(list(range(W)))  # every process takes part in creating each group
            if rank >= W:
                continue
            for use_moe in (False, True):
                model = fresh(use_moe)
                ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group) if W > 1 else model
                opt = GradientRecorder(model.parameters())
                layout = D.rank_micro_batches(B, M, W, rank)
                rows = global_batch()
                m = optimizer_step(ddp, opt, make_grad_scaler(torch.float32, "cpu"),
                                   [rows[a:b] for a, b, _ in layout], lr=0.0, grad_clip=1e9,
                                   shares=[w for *_, w in layout], world_size=W)
                loss = torch.stack([m.loss, m.aux_loss]) * m.share  # the trainer's mean over ranks
                dist.all_reduce(loss, group=group)
                result[W, use_moe] = {"grads": opt.grads, "loss": loss.tolist(), "names":
                                      [n for n, _ in model.named_parameters()]}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        leave_process_group()


def reference(use_moe: bool, W: int) -> tuple[dict, list[float]]:
    """One process, no DDP, none of minilm.step: the lm loss's mean over every target of the whole global batch,
    plus (MoE) the aux loss of each micro-batch the W ranks run, weighted by its share of the batch."""
    model, rows = fresh(use_moe), global_batch()
    lm = model(rows[:, :-1], targets=rows[:, 1:]).loss
    aux = torch.zeros(())
    if use_moe:
        for r in range(W):
            for a, b, _ in D.rank_micro_batches(B, M, W, r):
                aux = aux + model(rows[a:b, :-1], targets=rows[a:b, 1:]).aux_loss * (b - a) / B
    (lm + aux).backward()
    return {n: p.grad for n, p in model.named_parameters()}, [float(lm + aux), float(aux)]


@pytest.fixture(scope="module")
def rank0_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic_sizes")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=max(SIZES), join=True)
    return torch.load(out / "rank0.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("use_moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("W", SIZES)
def test_one_step_gradient_at_every_world_size(rank0_results, W, use_moe):
    got = rank0_results[W, use_moe]
    want, (want_loss, want_aux) = reference(use_moe, W)
    grads = dict(zip(got["names"], got["grads"], strict=True))
    assert max_rel_diff(grads, want) < 2e-5, (W, use_moe)
    assert got["loss"][0] == pytest.approx(want_loss, rel=1e-5) and got["loss"][1] == pytest.approx(want_aux, rel=1e-5)
    if use_moe:
        assert want_aux > 0
