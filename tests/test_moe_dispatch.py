"""The MoE layer's two dispatches (minilm.model.MoEFeedForward): the grouped one, with no host read, gives the split
one's outputs, aux loss, expert load and gradients; under grouped_mm's CUDA rules (a stand-in on CPU); compiled
without a graph break; and "auto" picks it only where the op has its sync-free kernel."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minilm import model as model_module
from minilm.config import ModelConfig
from minilm.model import GROUP_ROWS, MoEFeedForward, grouped_mm_kernel_on


def make_moe(top_k: int, norm_topk_prob: bool = True, experts: int = 4, hidden: int = 32, seed: int = 0):
    cfg = ModelConfig(hidden_size=hidden, num_attention_heads=2, num_key_value_heads=1, use_moe=True,
                      num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                      router_aux_loss_coef=0.1)
    torch.manual_seed(seed)
    moe = MoEFeedForward(cfg).train()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.weight[:, 0] = 0.0
        moe.gate.weight[-1, 0] = -3.0  # with inputs() feature 0 at 5: the last expert gets no token, an empty group
    return moe


def inputs(*shape):
    x = torch.randn(*shape)
    x[..., 0] = 5.0
    return x


def fp32_close(actual, expected, msg=None):
    """Equal up to fp32 rounding of sums in another order: 1e-6 of the tensor's largest magnitude."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()), msg=msg)


def run(moe, x, dispatch, monkeypatch, dtype=None):
    monkeypatch.setattr(MoEFeedForward, "dispatch", dispatch)
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        y = moe(x)
    (y.float().square().sum() + moe.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y.detach(), moe.aux_loss.detach(), moe.expert_load.clone(), x.grad, grads


@pytest.mark.parametrize("projections", ["split", "fused"])  # the split dispatch's experts: gate|up fused or not
@pytest.mark.parametrize("top_k, norm", [(1, True), (2, True), (2, False)])
def test_grouped_dispatch_matches_split_fp32(monkeypatch, top_k, norm, projections):
    monkeypatch.setattr(model_module, "PROJECTIONS", projections)
    moe = make_moe(top_k, norm)
    x = inputs(3, 11, 32)
    split = run(moe, x, "split", monkeypatch)
    grouped = run(moe, x, "grouped", monkeypatch)
    assert split[2][-1] == 0  # the empty expert: its group has only padding rows
    for a, b in zip(split[:4], grouped[:4], strict=True):
        fp32_close(b, a)
    assert set(split[4]) == set(grouped[4])
    for name, g in split[4].items():
        fp32_close(grouped[4][name], g, name)
    assert grouped[4]["experts.3.up_proj.weight"].abs().sum() == 0  # the empty expert: a zero gradient, not None


class CudaRulesGroupedMM:
    """torch._grouped_mm as its sync-free CUDA kernel takes it, checked on CPU: bf16 operands, int32 group ends
    that are multiples of 16 bytes of rows (the weight gradient contracts over them), the last one the row count,
    fewer than 1024 groups, strides in multiples of 16 bytes and 16-byte aligned data, no bias."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    @staticmethod
    def check_strides(name, mat):
        align = 16 // mat.element_size()
        st, sz = mat.stride(), mat.shape
        assert mat.data_ptr() % 16 == 0, f"{name}: data not 16-byte aligned"
        if st[-2] == 1 and st[-1] >= max(1, sz[-2]):
            assert st[-1] % align == 0, f"{name}: stride {st} not in 16 bytes"
        elif st[-1] == 1 and st[-2] >= max(1, sz[-1]):
            assert st[-2] % align == 0, f"{name}: stride {st} not in 16 bytes"
        else:
            raise AssertionError(f"{name}: strides {st} for sizes {tuple(sz)}")

    def __call__(self, a, b, offs=None, bias=None, out_dtype=None):
        self.calls += 1
        assert a.dtype == b.dtype == torch.bfloat16 and bias is None and out_dtype in (None, torch.bfloat16)
        assert offs is not None and offs.dtype == torch.int32 and offs.dim() == 1 and offs.numel() < 1024
        self.check_strides("mat_a", a)
        self.check_strides("mat_b", b)
        ends = offs.tolist()
        grouped_rows = a.shape[0] if b.dim() == 3 else a.shape[1]  # 2d x 3d: rows of a; 2d x 2d: its columns
        assert ends == sorted(ends) and ends[-1] == grouped_rows, (ends, grouped_rows)
        assert all(end % (16 // a.element_size()) == 0 for end in ends), ends
        return self.real(a, b, offs=offs)


def test_grouped_dispatch_under_the_cuda_rules_matches_split_bf16(monkeypatch):
    assert GROUP_ROWS * 2 == 16
    stand_in = CudaRulesGroupedMM(torch._grouped_mm)
    moe = make_moe(2)
    x = inputs(2, 13, 32)
    split = run(moe, x, "split", monkeypatch, torch.bfloat16)
    monkeypatch.setattr(torch, "_grouped_mm", stand_in)
    grouped = run(moe, x, "grouped", monkeypatch, torch.bfloat16)
    assert stand_in.calls == 9  # 3 projections forward, 2 grouped matmuls each backward
    assert grouped[0].dtype == split[0].dtype
    for a, b in zip(split[:4], grouped[:4], strict=True):  # bf16 rounding: a few of its ulps at the largest value
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2 * float(a.float().abs().max()))
    for name, g in split[4].items():
        torch.testing.assert_close(grouped[4][name], g, rtol=2e-2, atol=2e-2 * float(g.abs().max()), msg=name)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (.item(), bool(), ...: a device sync on CUDA)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_grouped_dispatch_reads_nothing_on_the_host_and_compiles_without_a_graph_break(monkeypatch):
    import torch._dynamo

    moe = make_moe(2)
    x = inputs(2, 16, 32)
    monkeypatch.setattr(MoEFeedForward, "dispatch", "grouped")
    with HostReads() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = moe(x.requires_grad_(True))
        (y.float().sum() + moe.aux_loss).backward()
    assert mode.reads == 0

    def forward(inp):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return moe(inp)

    torch._dynamo.reset()
    grouped = torch._dynamo.explain(forward)(x)
    assert grouped.graph_break_count == 0 and grouped.graph_count == 1, grouped.break_reasons
    monkeypatch.setattr(MoEFeedForward, "dispatch", "split")
    torch._dynamo.reset()
    split = torch._dynamo.explain(forward)(x)  # the host-sized split: the break this dispatch removes
    assert split.graph_break_count >= 1
    torch._dynamo.reset()


def test_auto_picks_grouped_only_where_the_sync_free_kernel_is(monkeypatch):
    moe = make_moe(1)
    x = torch.randn(4, 32)
    assert MoEFeedForward.dispatch == "auto" and not moe.grouped_kernel  # on CPU: split, the exact loop
    assert not moe.uses_grouped_dispatch(x)
    moe.grouped_kernel = True  # as after .to() onto an sm90/sm100 GPU
    assert not moe.uses_grouped_dispatch(x)  # fp32: grouped_mm would read its offsets on the host
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.uses_grouped_dispatch(x)
    assert moe.uses_grouped_dispatch(x.bfloat16())

    # sm90 and sm100 have the kernel; an A100 (8.0) has the op's fallback, which reads the offsets on the host
    for capability, kernel in [((9, 0), True), ((10, 0), True), ((8, 0), False)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert grouped_mm_kernel_on(torch.device("cuda", 0)) is kernel, capability
    assert not grouped_mm_kernel_on(torch.device("cpu"))
    moe.float()  # _apply re-reads the weights' device: CPU
    assert not moe.grouped_kernel


def test_a_torch_without_grouped_mm_takes_the_split_dispatch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert grouped_mm_kernel_on(torch.device("cuda", 0))
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not grouped_mm_kernel_on(torch.device("cuda", 0))
    assert model_module.grouped_mm_kernel_on is grouped_mm_kernel_on


def test_bench_step_times_both_dispatches_side_by_side(tmp_path, monkeypatch, capsys):
    from bench import step as bench_step

    monkeypatch.setenv("MINILM_BENCH_RESULTS", str(tmp_path))
    assert bench_step.main(["--hidden-size", "64", "--num-hidden-layers", "1", "--vocab-size", "256", "--seq-len",
                            "16", "--micro-batch-size", "2", "--steps", "1", "--warmup", "0", "--dtype", "fp32",
                            "--experts", "4", "--top-k", "2", "--dispatch", "split", "grouped",
                            "--peak-size", "128"]) == 0
    out = capsys.readouterr().out
    assert "grouped / split dispatch step time (fp32, 4 experts, top-2): " in out
    rows = json.loads((tmp_path / "step.json").read_text())["results"][0]["rows"]
    assert [(r["config"], r["dispatch"]) for r in rows] == [
        ("dense", None), ("moe 4x top-2 split", "split"), ("moe 4x top-2 grouped", "grouped")]
    assert MoEFeedForward.dispatch == "auto"  # the benchmark leaves the process's default as it found it
