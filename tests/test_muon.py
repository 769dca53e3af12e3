"""Muon (minilm.muon) through minilm.step.make_optimizer: which parameters it moves, its learning
rates, an exactly resumable state, a skipped step that changes nothing (found_inf, no host sync),
and the same update on every DDP rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import NoHostReads, bitwise_equal
from safetensors.torch import load_file, save_file

from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import leave_process_group
from minilm.model import MiniMindForCausalLM
from minilm.muon import NS_COEFFICIENTS, Muon, native_bf16, orthogonalize
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step, set_lr

SEQ, MICRO, ACCUMULATION, VOCAB = 16, 2, 2, 64


def tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=SEQ + 1, **kw)


def muon_cfg(**kw) -> TrainConfig:
    return TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, **kw)


def fresh(seed: int = 0, **model_kw) -> tuple[MiniMindForCausalLM, Muon]:
    torch.manual_seed(seed)
    model = MiniMindForCausalLM(tiny_cfg(**model_kw))
    return model, make_optimizer(model, muon_cfg())


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, VOCAB, (MICRO * ACCUMULATION, SEQ + 1), generator=gen)


def train(model, opt, steps: range) -> None:
    scaler = make_grad_scaler(torch.float32, "cpu")
    for step in steps:
        optimizer_step(model, opt, scaler, list(batch(step).split(MICRO)), lr=1e-3 * (1 - step / 20), grad_clip=1.0)


@pytest.mark.parametrize("shape", [(32, 32), (32, 88), (88, 32), (7, 300)])
def test_orthogonalize_gives_unit_singular_values(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g)
    assert o.shape == g.shape and o.dtype == g.dtype
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25  # Newton-Schulz lands near 1, not exactly on it
    # The same directions as g: o ~ U V^T of g.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(o.flatten(), (u @ vh).flatten(), dim=0) > 0.95


@pytest.mark.parametrize("native", [False, True])
def test_newton_schulz_runs_in_bf16_only_where_the_device_has_it_natively(monkeypatch, native):
    """An emulated bf16 matmul is ~10x slower than fp32 on a CPU: a third of a CPU step went to Newton-Schulz."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    seen = []
    real_matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda x, y: seen.append(x.dtype) or real_matmul(x, y))
    orthogonalize(torch.randn(8, 16))
    assert seen and set(seen) == {torch.bfloat16 if native else torch.float32}
    assert native_bf16("cuda")


def test_block_matrices_on_muon_the_rest_on_adamw():
    model = MiniMindForCausalLM(tiny_cfg(use_moe=True))
    opt = make_optimizer(model, muon_cfg(weight_decay=0.1, embedding_lr_ratio=3.0))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert all(".layers." in n and n.endswith("_proj.weight") for n in muon)
    assert len(muon) == 2 * (4 + 3 * 4)  # q k v o, and gate/up/down of 4 experts, per layer
    assert sorted(decay) == ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                             "model.layers.1.mlp.gate.weight"]  # tied embedding/head and the routers
    assert all(n.endswith("norm.weight") for n in no_decay)
    assert sum(map(len, (muon, decay, no_decay))) == len(list(model.parameters()))
    ratio = 0.02 / 1e-3
    assert opt.param_groups[0]["use_muon"] and opt.param_groups[0]["lr_ratio"] == pytest.approx(ratio)
    # lr x decay per step is the same for every matrix (0.1 x lr): each group's decay is divided by its lr ratio.
    assert opt.param_groups[0]["weight_decay"] * ratio == pytest.approx(0.1)
    assert opt.param_groups[1]["weight_decay"] * 3.0 == pytest.approx(0.1)
    assert opt.param_groups[2]["weight_decay"] == 0.0
    set_lr(opt, 5e-4)  # the matrices at muon_lr's share, the embedding / head and routers at 3x, the gains at lr
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4 * ratio, 5e-4 * 3.0, 5e-4])


def test_muon_trains():
    model, opt = fresh()
    scaler = make_grad_scaler(torch.float32, "cpu")
    pattern = torch.arange(3, 3 + SEQ + 1).repeat(MICRO, 1)
    losses = [float(optimizer_step(model, opt, scaler, [pattern], lr=1e-3, grad_clip=1.0).loss) for _ in range(25)]
    assert losses[-1] < 0.8 * losses[0]


def test_resumed_run_is_bitwise_equal_to_uninterrupted(tmp_path):
    model, opt = fresh()
    train(model, opt, range(6))

    model_a, opt_a = fresh()
    train(model_a, opt_a, range(3))
    save_file({k: v.detach().clone().contiguous() for k, v in model_a.state_dict().items()}, tmp_path / "model.safetensors")
    torch.save(opt_a.state_dict(), tmp_path / "optimizer.pt")
    del model_a, opt_a

    model_b, opt_b = fresh(seed=123)  # other initial weights: everything must come from the files
    model_b.load_state_dict(load_file(tmp_path / "model.safetensors"))
    opt_b.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    train(model_b, opt_b, range(3, 6))
    assert bitwise_equal(model.state_dict(), model_b.state_dict())
    assert all(bitwise_equal(sa, sb) for sa, sb in zip(opt.state.values(), opt_b.state.values(), strict=True))


def snapshot(model, opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + \
           [t.clone() for s in opt.state.values() for t in s.values()]


def step_with_grads(model, opt, grads, found_inf):
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    opt.found_inf = found_inf
    opt.step()
    opt.found_inf = None


def test_found_inf_skips_the_step_bitwise_without_a_host_sync():
    model, opt = fresh()
    train(model, opt, range(2))  # non-empty state
    grads = [torch.randn_like(p) for p in model.parameters()]
    grads[0][0, 0] = float("nan")
    grads[5].fill_(float("inf"))
    before = snapshot(model, opt)
    with NoHostReads():
        step_with_grads(model, opt, grads, torch.tensor(1.0))
    after = snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_found_inf_zero_is_an_ordinary_step():
    (model_a, opt_a), (model_b, opt_b) = fresh(), fresh()
    train(model_a, opt_a, range(2))
    train(model_b, opt_b, range(2))
    grads = [torch.randn_like(p) for p in model_a.parameters()]
    step_with_grads(model_a, opt_a, grads, None)
    step_with_grads(model_b, opt_b, grads, torch.tensor(0.0))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(model_a, opt_a), snapshot(model_b, opt_b), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(snapshot(model_a, opt_a)[:3], snapshot(*fresh())[:3],
                                                     strict=True))


class LoopMuon(torch.optim.Optimizer):
    """minilm.muon.Muon as it was before its update was batched by shape: one parameter at a time, the same
    arithmetic (the reference of test_the_batched_update_is_the_per_parameter_loop)."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr, *, momentum=0.95, nesterov=True, ns_steps=5, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.0):
        super().__init__(params, {"lr": lr, "lr_ratio": 1.0, "weight_decay": weight_decay, "use_muon": False,
                                  "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                                  "betas": tuple(betas), "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        skip = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (self._muon if group["use_muon"] else self._adamw)(p, group, skip)

    def _muon(self, p, group, skip):
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, g, beta, lr = state["momentum_buffer"], p.grad, group["momentum"], group["lr"]
        new_buf = buf.lerp(g, 1 - beta)
        direction = g.lerp(new_buf, beta) if group["nesterov"] else new_buf
        a, b, c = NS_COEFFICIENTS
        x = direction.to(torch.bfloat16 if native_bf16(p.device) else torch.float32)
        wide = x.shape[0] > x.shape[1]
        x = x.T.contiguous() if wide else x
        x = x / (x.norm() + 1e-7)
        for _ in range(group["ns_steps"]):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b A + c A^2) x
        update = (x.T if wide else x).to(p.dtype) * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        self._commit(buf, new_buf, skip)
        self._commit(p, p * (1 - lr * group["weight_decay"]) - lr * update, skip)

    def _adamw(self, p, group, skip):
        state = self.state[p]
        if not state:
            state.update(step=torch.zeros((), device=p.device), exp_avg=torch.zeros_like(p),
                         exp_avg_sq=torch.zeros_like(p))
        (beta1, beta2), lr, g = group["betas"], group["lr"], p.grad
        step = state["step"] + 1
        exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
        denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt() + group["eps"]
        new_p = p * (1 - lr * group["weight_decay"]) - lr * (exp_avg / (1 - beta1 ** step)) / denom
        for old, new in ((state["step"], step), (state["exp_avg"], exp_avg), (state["exp_avg_sq"], exp_avg_sq),
                         (p, new_p)):
            self._commit(old, new, skip)

    @staticmethod
    def _commit(old, new, skip):
        old.copy_(new if skip is None else torch.where(skip > 0, old, new))


def test_the_batched_update_is_the_per_parameter_loop():
    # Muon's matrices are updated by foreach ops with the Newton-Schulz matmuls batched over same-shape matrices (a
    # few launches per shape, not ~40 per parameter); its AdamW part by torch's fused AdamW kernel. Against the loop
    # they replaced (LoopMuon above), skipped steps included: the matrices and their momentum bit for bit, the
    # AdamW parameters and moments to float rounding (another order of the same formula).
    model_a, opt_a = fresh()
    model_b, _ = fresh()
    opt_b = LoopMuon(make_optimizer(model_b, muon_cfg()).param_groups, lr=1e-3)
    muon = {p for g in opt_a.param_groups if g["use_muon"] for p in g["params"]}
    assert len({p.shape for p in muon}) < len(muon) // 2  # stacks of several matrices
    for step in range(4):
        grads = [torch.randn_like(p) for p in model_a.parameters()]
        skip = torch.tensor(float(step == 2))
        step_with_grads(model_a, opt_a, grads, skip)
        step_with_grads(model_b, opt_b, grads, skip)
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys(), name
        for a, b in ((p, q), *((sa[k], sb[k]) for k in sa)):
            if p in muon:
                assert torch.equal(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)
    assert int(opt_a.state[next(iter(muon))]["momentum_buffer"].ne(0).sum()) > 0
    assert all(float(opt_a.state[p]["step"]) == 3 for p in model_a.parameters() if p not in muon)  # one skipped
    assert not torch.equal(next(model_a.parameters()), next(fresh()[0].parameters()))  # it moved


def test_muon_takes_only_matrices():  # its settings' rules: TRAIN_CASES in tests/test_config.py
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}], lr=1e-3)


# ---- DDP: every rank applies the same update ------------------------------------------------------

WORLD = 2


def _ddp_worker(rank: int, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick in advance, so no race with other processes for it.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        model, opt = fresh()
        ddp = DDP(model)
        scaler = make_grad_scaler(torch.float32, "cpu")
        for step in range(4):
            mine = batch(step).chunk(WORLD)[rank]  # each rank its own half of the global batch
            optimizer_step(ddp, opt, scaler, list(mine.split(MICRO // WORLD or 1)), lr=1e-3, grad_clip=1.0)
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        leave_process_group()  # not left to interpreter exit: see minilm.distributed


def test_every_ddp_rank_applies_the_same_update(tmp_path):
    mp.spawn(_ddp_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(WORLD))
    start, _ = fresh()
    assert bitwise_equal(rank0, rank1)
    assert not torch.equal(rank0["model.layers.0.self_attn.q_proj.weight"],
                           start.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_muon_is_in_the_tune_search_space():
    from ray_jobs.tune import apply_params, parse_search

    dim = parse_search("optimizer=choice:adamw,muon")
    assert dim.values == ("adamw", "muon")
    assert parse_search("muon_lr=loguniform:0.005:0.05").values == (0.005, 0.05)
    _, t = apply_params(tiny_cfg(), TrainConfig(), {"optimizer": "muon", "muon_lr": 0.01, "embedding_lr_ratio": 2.0})
    assert t.validate().optimizer == "muon" and t.muon_lr == 0.01 and t.embedding_lr_ratio == 2.0
