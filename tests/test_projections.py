"""Fused projections (minilm.model.project: q|k|v and gate|up as one matmul each over the separate Linears' weights)
against the unfused math, with MiniMind's state-dict keys; the GQA path (`Attention.gqa`): both paths equal, the
chooser picks the faster, and only a CUDA device is timed."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from cuda_standin import CudaRules
from test_model import TINY, expected_keys, make_model
from torch.utils._python_dispatch import TorchDispatchMode

from minilm import model as M
from minilm.config import ModelConfig
from minilm.model import Attention, apply_rope, choose_gqa, resolve_gqa


class Matmuls(TorchDispatchMode):
    """Counts the matmuls run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def unfused_block(block, x, cos, sin):
    """One block by hand, one matmul per Linear (the code before `project`), no mask."""
    attn, mlp = block.self_attn, block.mlp
    b, t, _ = x.shape
    h = block.input_layernorm(x)
    q = attn.q_norm(F.linear(h, attn.q_proj.weight).view(b, t, attn.num_heads, attn.head_dim))
    k = attn.k_norm(F.linear(h, attn.k_proj.weight).view(b, t, attn.num_kv_heads, attn.head_dim))
    v = F.linear(h, attn.v_proj.weight).view(b, t, attn.num_kv_heads, attn.head_dim)
    q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.transpose(1, 2).repeat_interleave(rep, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    x = x + F.linear(y, attn.o_proj.weight)
    h = block.post_attention_layernorm(x)
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def test_fused_projections_are_one_matmul_each_with_the_unfused_outputs_gradients_and_keys(monkeypatch):
    model = make_model().train()
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    block, inner = model.model.layers[0], model.model
    x = torch.randn(2, 9, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    cos, sin = inner.freqs_cos[:9], inner.freqs_sin[:9]
    outputs, grads = [], []
    for run in ("fused", "by hand"):
        monkeypatch.setattr(M, "PROJECTIONS", "fused")
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with Matmuls() as matmuls:
            y = block(xi, cos, sin)[0] if run == "fused" else unfused_block(block, xi, cos, sin)
        assert matmuls.count == (4 if run == "fused" else 7)  # q|k|v, o, gate|up, down against 7 Linears
        y.square().sum().backward()
        outputs.append(y.detach())
        grads.append({"x": xi.grad, **{n: p.grad for n, p in block.named_parameters()}})
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    assert set(grads[0]) == set(grads[1]) and all(g is not None for g in grads[0].values())
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-5, atol=1e-6, msg=name)
    state = model.state_dict()  # the parameters are the separate Linears': MiniMind's keys, the weights untouched
    assert set(state) == expected_keys(2, False) and all(torch.equal(state[k], v) for k, v in keys.items())


@pytest.mark.parametrize("use_moe", [False, True])
def test_the_model_fused_and_split_gives_the_same_loss_and_gradients(monkeypatch, use_moe):
    # MoE: the split dispatch runs each expert's FeedForward (fused inside); tests/test_moe_dispatch.py covers grouped
    model = make_model(use_moe=use_moe).train()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(2))
    runs = []
    for mode in ("split", "fused"):
        monkeypatch.setattr(M, "PROJECTIONS", mode)
        runs.append(loss_and_gradients(model, ids))
    assert_same_run(*runs)


def loss_and_gradients(model, ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_run(a, b) -> None:
    """The same loss, and each parameter's gradient, to float rounding."""
    torch.testing.assert_close(b[0], a[0], rtol=1e-6, atol=0)
    for name, g in a[1].items():
        torch.testing.assert_close(b[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_auto_keeps_one_matmul_per_linear_on_cpu(monkeypatch):
    monkeypatch.setattr(M, "PROJECTIONS", "auto")
    block = make_model().model.layers[0]
    with Matmuls() as matmuls:
        block.mlp(torch.randn(1, 3, TINY["hidden_size"]))
    assert matmuls.count == 3  # gate, up, down: the CPU path (bench/RESULTS.md, the fused projections on CPU)


def test_bench_step_times_fused_and_split_projections_side_by_side(tmp_path, monkeypatch):
    from bench import step as bench_step

    seen, project = set(), M.project
    monkeypatch.setattr(M, "project", lambda *a: seen.add(M.PROJECTIONS) or project(*a))
    monkeypatch.setenv("MINILM_BENCH_RESULTS", str(tmp_path))
    assert bench_step.main(["--hidden-size", "64", "--num-hidden-layers", "1", "--vocab-size", "256", "--seq-len",
                            "16", "--micro-batch-size", "2", "--steps", "1", "--warmup", "0", "--dtype", "fp32",
                            "--no-moe", "--projections", "fused", "split", "--peak-size", "128"]) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["results"][0]["rows"]
    assert [(r["config"], r["projections"]) for r in rows] == [("dense", "fused"), ("dense split", "split")]
    assert seen == {"fused", "split"} and M.PROJECTIONS == "auto"  # the process's default, as it was


# ---- GQA: SDPA's enable_gqa or K/V repeated -----------------------------------------------------------

def test_choose_gqa_takes_the_faster_path_by_its_best_time_the_paths_alternating():
    calls = []

    def timer(times):
        def seconds(path):
            calls.append(path)
            return times[path][sum(c == path for c in calls) - 1]
        return seconds

    assert choose_gqa(timer({"sdpa": [9.0, 1.0, 5.0], "repeat": [2.0, 2.0, 2.0]})) == "sdpa"  # a slow first call
    assert calls == ["sdpa", "repeat"] * 3
    calls.clear()
    assert choose_gqa(timer({"sdpa": [3.0, 3.0, 3.0], "repeat": [4.0, 2.5, 9.0]})) == "repeat"


def test_both_gqa_paths_give_the_same_outputs_and_gradients(monkeypatch):
    calls = []
    repeat = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: calls.append(1) or repeat(*a, **k))
    model = make_model(num_attention_heads=8, num_key_value_heads=2).train()
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))
    runs = []
    for path in ("sdpa", "repeat"):
        monkeypatch.setattr(Attention, "gqa", path)
        calls.clear()
        runs.append(loss_and_gradients(model, ids))
        assert len(calls) == (0 if path == "sdpa" else 4)  # K and V in each of 2 layers
    assert_same_run(*runs)


def test_resolve_gqa_times_both_paths_on_cuda_only(monkeypatch):
    monkeypatch.setattr(Attention, "gqa", "auto")
    cfg = ModelConfig(**TINY)
    timed = []
    monkeypatch.setattr(M, "choose_gqa", lambda seconds: timed.append([seconds(p) > 0 for p in ("sdpa", "repeat")])
                        or "repeat")
    assert resolve_gqa(cfg, 2, 16, torch.float32, torch.device("cpu")) == "sdpa" and Attention.gqa == "auto"
    assert resolve_gqa(ModelConfig(**TINY, document_mask=True), 2, 16, torch.float32, torch.device("cuda")) == "repeat"
    assert timed == []  # nothing timed on CPU, nor with a mask (which always repeats)
    with CudaRules():
        assert resolve_gqa(cfg, 2, 16, torch.float32, torch.device("cuda")) == "repeat"
    assert timed == [[True, True]] and Attention.gqa == "repeat"
    assert resolve_gqa(cfg, 2, 16, torch.float32, torch.device("cuda")) == "repeat" and len(timed) == 1  # once

