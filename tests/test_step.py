"""The per-worker optimizer step: accumulation is exact, clipping happens in unscaled units,
non-finite steps are skipped and, repeated, stop the run."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, NoHostReads

from minilm import step as S
from minilm.config import ModelConfig, TrainConfig
from minilm.distributed import Collectives, leave_process_group
from minilm.model import CausalLMOutput, MiniMindForCausalLM, MoEFeedForward
from minilm.step import (
    MUON_MAX_SHARE,
    NonFiniteGuard,
    NonFiniteLossError,
    StepMetrics,
    choose_optimizer,
    configure_backends,
    make_grad_scaler,
    make_optimizer,
    optimizer_step,
    prepare_model,
    resolve_auto,
    resolve_dtype,
)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
            max_position_embeddings=256)
SEQ = 16  # tokens per row are SEQ + 1: input and shifted labels


def make_model(seed: int = 0, **kw) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(ModelConfig(**{**TINY, **kw})).train()


def batch(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def fp32_scaler():
    return make_grad_scaler(torch.float32, "cpu")


def adamw(model, **kw):
    return make_optimizer(model, TrainConfig(optimizer="adamw", **kw))


def step(model, micro_batches, opt=None, lr=1e-3, **kw) -> StepMetrics:
    """One optimizer_step at clip 1.0 with the fp32 (disabled) scaler; a fresh AdamW unless `opt` is given."""
    return optimizer_step(model, opt or adamw(model), fp32_scaler(), list(micro_batches), lr=lr, grad_clip=1.0, **kw)


# ---- gradient accumulation ------------------------------------------------------------------------

def run_steps(micro: int, use_moe: bool, coef: float, steps: int = 2, lr: float = 1e-4):
    """`steps` optimizer steps on 8 sequences each, split into micro-batches of `micro`; returns the
    model, the metrics and the gradients AdamW saw at each step (after clipping)."""
    model = make_model(use_moe=use_moe, router_aux_loss_coef=coef)
    opt = adamw(model, lr=lr, weight_decay=0.1)
    grads: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: grads.append([p.grad.clone() for g in o.param_groups for p in g["params"]]))
    metrics = [step(model, batch(8, seed=100 + s).split(micro), opt, lr=lr) for s in range(steps)]
    return model, metrics, grads


# MoE: the load-balancing loss is a statistic of each micro-batch (load x mean prob over the
# micro-batch's tokens), not a per-token sum, so it is not linear in the batch: the mean of four
# 2-sequence aux losses is not the aux loss of the 8-sequence batch. The equality therefore holds
# for the lm part only, so the MoE case runs with router_aux_loss_coef=0 (routing still runs and
# still shapes the gradients). test_moe_aux_loss_is_per_micro_batch shows the difference.
@pytest.mark.parametrize("use_moe,coef", [(False, 0.0), (True, 0.0)], ids=["dense", "moe-coef0"])
def test_accumulation_4x2_equals_1x8(use_moe, coef):
    acc, acc_m, acc_g = run_steps(micro=2, use_moe=use_moe, coef=coef)
    big, big_m, big_g = run_steps(micro=8, use_moe=use_moe, coef=coef)
    # AdamW divides each coordinate by sqrt(v): on its first steps a coordinate moves by ~lr whatever
    # its size, so fp32 rounding in a near-zero gradient shows up as up to ~lr * 1e-3 in the weights.
    # lr=1e-4 keeps that well inside atol 1e-6; the gradients themselves are compared tightly below.
    for (name, a), b in zip(acc.named_parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    for ga, gb in zip(acc_g, big_g, strict=True):
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for ma, mb in zip(acc_m, big_m, strict=True):
        torch.testing.assert_close(ma.loss, mb.loss, rtol=1e-6, atol=1e-6)
        # Dividing by accumulation_steps before backward makes the accumulated gradient the mean:
        # the same norm as the one big batch (without the division it would be 4x).
        torch.testing.assert_close(ma.grad_norm, mb.grad_norm, rtol=1e-5, atol=1e-6)
        assert ma.sequences == mb.sequences == 8 and ma.tokens == mb.tokens == 8 * SEQ
    # The run really moved the weights (an equality of two no-ops would prove nothing).
    assert (acc.lm_head.weight - make_model(use_moe=use_moe).lm_head.weight).abs().max() > 1e-4


def test_accumulation_without_division_would_be_a_sum():
    """The counterfactual: without `/ accumulation_steps` the window's gradient is 4x the mean."""
    model, data = make_model(), batch(8, seed=100)
    summed = copy.deepcopy(model)
    for m in data.split(2):
        summed(m, labels=m).loss.backward()  # no division
    mean = copy.deepcopy(model)
    mean(data, labels=data).loss.backward()
    for a, b in zip(summed.parameters(), mean.parameters(), strict=True):
        torch.testing.assert_close(a.grad, 4 * b.grad, rtol=1e-4, atol=1e-7)


def test_moe_aux_loss_is_per_micro_batch():
    _, acc_m, _ = run_steps(micro=2, use_moe=True, coef=0.05, steps=1)
    _, big_m, _ = run_steps(micro=8, use_moe=True, coef=0.05, steps=1)
    torch.testing.assert_close(acc_m[0].lm_loss, big_m[0].lm_loss, rtol=1e-6, atol=1e-6)  # lm part: equal
    assert acc_m[0].aux_loss.item() > 0 and big_m[0].aux_loss.item() > 0
    assert acc_m[0].aux_loss.item() != pytest.approx(big_m[0].aux_loss.item(), rel=1e-6)  # aux part: not


def test_metrics_are_window_means():
    model = make_model()
    data = batch(8, seed=7)
    with torch.no_grad():
        per_micro = [model(m, labels=m).loss for m in data.split(2)]
    m = step(model, data.split(2))
    torch.testing.assert_close(m.lm_loss, torch.stack(per_micro).mean())
    assert m.aux_loss.item() == 0.0 and m.lr == 1e-3 and not m.skipped
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)


# ---- clipping after unscale -----------------------------------------------------------------------

def unscaled_grad_norm(model, data) -> float:
    m = copy.deepcopy(model)
    m(data, labels=data).loss.backward()
    return torch.nn.utils.clip_grad_norm_(list(m.parameters()), float("inf")).item()


def test_clip_after_unscale_with_grad_scaler():
    """fp16-style loss scaling on CPU: the GradScaler multiplies the loss by S; optimizer_step
    unscales before clipping, so the update is clipped to grad_clip in true units."""
    model, data = make_model(), batch(4, seed=1)
    true_norm = unscaled_grad_norm(model, data)
    clip, scale = 0.01, 2.0**16
    assert true_norm > 10 * clip  # the clip is active
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # update = -grad: the update *is* the clipped grad
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=True)
    assert scaler.is_enabled() and scaler.get_scale() == scale  # a GradScaler works on CPU
    before = params_of(model)
    m = optimizer_step(model, sgd, scaler, [data], lr=1.0, grad_clip=clip)
    assert m.grad_norm.item() == pytest.approx(true_norm, rel=1e-4)  # reported in unscaled units
    update = torch.cat([(before[k] - p.detach()).flatten() for k, p in model.named_parameters()])
    assert update.norm().item() == pytest.approx(clip, rel=1e-4)
    assert not m.skipped and scaler.get_scale() == scale  # no overflow: scale unchanged


def test_clip_before_unscale_is_wrong():
    """The same step with the two lines swapped: clipping the *scaled* gradient to grad_clip, then
    unscaling, leaves an effective norm of grad_clip / S, S times too small."""
    clip, scale = 0.01, 2.0**16
    model, data = make_model(), batch(4, seed=1)

    # By hand: multiply the loss by S, clip, then divide by S.
    m = copy.deepcopy(model)
    (m(data, labels=data).loss * scale).backward()
    torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
    for p in m.parameters():
        p.grad /= scale
    wrong = torch.cat([p.grad.flatten() for p in m.parameters()]).norm().item()
    assert wrong == pytest.approx(clip / scale, rel=1e-4)

    # With a real GradScaler: clip, then scaler.step, which unscales in place before stepping. The
    # gradient the optimizer used (p.grad after the step) has norm grad_clip / S, S times too small.
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=True)
    scaler.scale(model(data, labels=data).loss).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
    scaler.step(sgd)
    used = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    assert used == pytest.approx(clip / scale, rel=1e-4)
    assert used < clip / 1000


def test_scaler_overflow_skips_and_backs_off():
    model, data = make_model(), batch(4, seed=2)
    opt = adamw(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=True)
    handle = model.model.norm.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    before = params_of(model)
    m = optimizer_step(model, opt, scaler, [data], lr=1e-3, grad_clip=1.0)
    handle.remove()
    assert m.skipped and scaler.get_scale() == 2.0**15  # GradScaler halves its scale on overflow
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters())


# ---- non-finite steps -----------------------------------------------------------------------------

def test_inf_gradient_skips_step_and_keeps_weights():
    model, data = make_model(), batch(4, seed=3)
    opt = adamw(model)
    before = params_of(model)
    handle = model.model.layers[0].self_attn.q_proj.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    m = step(model, data.split(2), opt)
    handle.remove()
    assert m.skipped and not torch.isfinite(m.grad_norm)
    assert torch.isfinite(m.loss)  # the loss was fine; only the gradient was not
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters())
    # AdamW skipped on the device (found_inf): its step count stayed 0 and no moment was polluted by inf
    assert all(int(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in opt.state.values())
    assert all(p.grad is None for p in model.parameters())  # the bad gradient is gone

    m = step(model, data.split(2), opt)
    assert not m.skipped
    assert not torch.equal(before["model.embed_tokens.weight"], model.lm_head.weight)


class InfLoss(torch.nn.Module):
    """A model whose loss is infinite, as a corrupt batch or an lr blow-up would make it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, **kwargs):
        out = self.inner(input_ids, **kwargs)
        return CausalLMOutput(out.logits, out.loss * float("inf"), out.aux_loss)


def test_inf_loss_skips_step():
    model, data = InfLoss(make_model()), batch(4, seed=4)
    before = params_of(model.inner)
    m = step(model, [data])
    assert m.skipped and not torch.isfinite(m.loss)
    assert all(torch.equal(before[k], p) for k, p in model.inner.named_parameters())


def feed(guard, steps, skipped: bool = True, loss: float = float("inf"), **kw) -> NonFiniteGuard:
    """guard.update at each of `steps` with the metrics of a step (skipped or not) of that loss."""
    t = torch.tensor(loss)
    metrics = StepMetrics(loss=t, lm_loss=t, aux_loss=torch.tensor(0.0), grad_norm=torch.tensor(float("nan")),
                          lr=1e-3, skipped=torch.tensor(skipped), sequences=8, tokens=128)
    for step in steps:
        guard.update(metrics, step, **kw)
    return guard


def test_guard_trips_after_k_in_a_row_and_check_names_the_steps():
    guard = feed(feed(NonFiniteGuard(3), [9], skipped=False), [10, 11])
    guard.check()  # two in a row: no trip yet
    assert not guard.tripped()
    feed(guard, [12])
    assert guard.tripped()
    feed(guard, [13], skipped=False)  # a later good step does not undo the trip the ranks will act on
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row \(10\.\.12\)") as ei:
        guard.check()
    assert "--lr" in str(ei.value)  # tells the user what to do


def test_guard_resets_on_good_step():
    guard = feed(feed(NonFiniteGuard(3), [0, 1]), [2], skipped=False)
    assert int(guard.in_a_row) == 0 and int(guard.skipped_total) == 2
    feed(guard, [3, 4]).check()
    feed(guard, [5])
    with pytest.raises(NonFiniteLossError, match=r"\(3\.\.5\)"):
        guard.check()


def test_guard_ignores_scaler_overflow_with_finite_loss():
    # GradScaler calibration: skipped steps with a finite loss
    guard = feed(NonFiniteGuard(2), range(10), loss=3.0, scaler_enabled=True)
    assert int(guard.in_a_row) == 0 and int(guard.skipped_total) == 10 and not guard.tripped()
    feed(guard, [10, 11], scaler_enabled=True)
    with pytest.raises(NonFiniteLossError):
        guard.check()


def test_guard_state_dict_round_trip():
    guard = feed(NonFiniteGuard(3), [20, 21])
    resumed = NonFiniteGuard(3)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.state_dict() == guard.state_dict() == {"skipped_total": 2, "in_a_row": 2,
                                                           "first_step_in_a_row": 20}
    feed(resumed, [22])
    with pytest.raises(NonFiniteLossError, match=r"\(20\.\.22\)"):
        resumed.check()


@pytest.mark.parametrize("inject_inf", [False, True])
def test_the_step_reads_nothing_back_from_the_device(inject_inf):
    """optimizer_step and the guard run without a host sync, also when a non-finite step is skipped."""
    model, data = make_model(), batch(4, seed=6)
    opt = adamw(model)
    guard = NonFiniteGuard(3)
    handle = model.lm_head.weight.register_hook(lambda g: g * float("inf")) if inject_inf else None
    before = params_of(model)
    with NoHostReads():
        for n in range(1, 3):
            m = step(model, data.split(2), opt)
            guard.update(m, n)
    if handle:
        handle.remove()
    assert bool(m.skipped) == inject_inf
    assert int(guard.skipped_total) == (2 if inject_inf else 0)
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters()) == inject_inf


# ---- precision and optimizer set-up ---------------------------------------------------------------

def test_resolve_dtype():
    assert resolve_dtype("fp32", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        resolve_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8", "cpu")
    assert not make_grad_scaler(torch.bfloat16, "cpu").is_enabled()
    assert not make_grad_scaler(torch.float32, "cpu").is_enabled()


def cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def test_auto_on_a_cpu_without_native_bf16_is_fp32_without_timing_a_matmul(monkeypatch):
    cpu_without_native_bf16(monkeypatch)
    monkeypatch.setattr(torch, "randn", lambda *a, **k: pytest.fail("the probe timed a matmul"))
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # native: the probe times it
    with pytest.raises(pytest.fail.Exception, match="timed a matmul"):
        resolve_dtype("auto", "cpu")


@pytest.mark.parametrize("ns_s, step_s, chosen", [
    (0.0, 1.0, "muon"), (0.03, 1.0, "muon"), (MUON_MAX_SHARE, 1.0, "muon"), (2.5, 10.0, "muon"),
    (0.45, 1.0, "muon"), (MUON_MAX_SHARE + 1e-9, 1.0, "adamw"), (0.8, 1.0, "adamw"), (3.0, 1.0, "adamw"),
    (None, None, "muon")])
def test_optimizer_auto_is_muon_while_newton_schulz_takes_at_most_half_a_step(ns_s, step_s, chosen):
    name, why = choose_optimizer(ns_s, step_s)
    assert name == chosen and why.startswith("auto: ")
    if ns_s is not None:
        assert f"Newton-Schulz {ns_s:.2f} s = {ns_s / step_s:.0%} of a step" in why, why
    else:
        assert "on a GPU" in why


def test_optimizer_auto_times_newton_schulz_on_a_cpu_where_it_dominates_adamw_else_muon(monkeypatch):
    """Measured: hidden 256 with 8 tokens a step is mostly Newton-Schulz, so adamw; with Newton-Schulz stubbed to take
    no time, muon. Both resolve --dtype auto too (fp32 without native bf16)."""
    cpu_without_native_bf16(monkeypatch)
    wide = ModelConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       vocab_size=256)
    cfg = TrainConfig(seq_len=8, micro_batch_size=1, global_batch_size=1)
    assert "of a step, muon up to 50%" in resolve_auto(wide, cfg, "cpu") and (cfg.optimizer, cfg.dtype) == (
        "adamw", "fp32")
    monkeypatch.setattr(S, "orthogonalize", lambda g: g)
    cfg = TrainConfig(seq_len=8, micro_batch_size=1, global_batch_size=1)
    # the timer's own overhead, times the matrices of each shape, is all that is left: a few percent at most
    assert resolve_auto(wide, cfg, "cpu").startswith("auto: Newton-Schulz 0.00 s = ")
    assert (cfg.optimizer, cfg.dtype) == ("muon", "fp32")


def test_optimizer_auto_times_a_real_forward_backward_per_sequence_of_rank_0(monkeypatch):
    """The step is timed on the model under the run's autocast, not estimated from its FLOPs at the matmul peak (a
    fifth of the real bf16 step on an AMX CPU): one sequence is timed, so a forward made 50 ms slower adds 50 ms for
    each of rank 0's 5 sequences (of the global 10 at world size 2)."""
    model_cfg = ModelConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=256)
    cfg = TrainConfig(seq_len=8, micro_batch_size=2, global_batch_size=10, dtype="bf16")
    _, unchanged = S.time_muon(model_cfg, cfg, world_size=2)
    forward, seen = MiniMindForCausalLM.forward, []

    def slow_forward(self, input_ids, targets=None):
        seen.append((tuple(input_ids.shape), torch.is_autocast_enabled("cpu")))
        time.sleep(0.05)
        return forward(self, input_ids, targets=targets)

    monkeypatch.setattr(MiniMindForCausalLM, "forward", slow_forward)
    _, slowed = S.time_muon(model_cfg, cfg, world_size=2)
    assert seen == [((1, 8), True)] * 2  # a warm-up and the timed one
    assert slowed >= 5 * 0.05 > unchanged


def test_a_model_past_this_machines_memory_is_refused_before_the_probe_builds_it(monkeypatch):
    """152,608 layers (a fuzzed config: under the config's bound) got the process killed mid-build: now a line."""
    monkeypatch.setattr(S, "MiniMindForCausalLM", lambda *a: pytest.fail("the model was built"))
    with pytest.raises(MemoryError, match=r"^1125.42B parameters need ~16770 GiB for weights, gradients and optimizer "
                                          r"state; this machine has \d+ GiB free$"):
        S.time_muon(ModelConfig(num_hidden_layers=152608), TrainConfig())
    S.check_memory(ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


def test_optimizer_auto_is_muon_on_a_gpu_and_a_given_optimizer_stays_without_timing(monkeypatch):
    monkeypatch.setattr(S, "time_muon", lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(S, "resolve_dtype", lambda name, device: torch.bfloat16)
    cfg = TrainConfig()
    assert resolve_auto(ModelConfig(), cfg, "cuda") == "auto: on a GPU Newton-Schulz is a few percent of a step"
    assert cfg.optimizer == "muon"
    for given in ("adamw", "muon"):
        cfg = TrainConfig(optimizer=given)
        assert resolve_auto(ModelConfig(), cfg, "cpu") == "" and cfg.optimizer == given


def test_bf16_autocast_step_keeps_fp32_master_weights():
    model, data = make_model(), batch(4, seed=5)
    m = step(model, [data], dtype=torch.bfloat16)
    assert torch.isfinite(m.loss) and not m.skipped
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_weight_decay_only_on_matrices():
    model = make_model()
    opt = adamw(model, weight_decay=0.1, betas=(0.8, 0.9))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()  # tied once
    assert decay["betas"] == (0.8, 0.9)


def test_collectives_are_identity_without_distributed():
    v = torch.tensor([1.0, 2.0])
    c = Collectives("cpu")
    assert torch.equal(c.sum(v), v) and c.world_size == 1


# ---- the step built for a GPU: seq_len positions, DDP's bucket views -----------------------------------------

def test_a_row_of_seq_len_plus_one_feeds_and_scores_seq_len_positions():
    # row[:, :-1] fed, row[:, 1:] scored: the model runs SEQ positions, not SEQ + 1 with the last output dropped,
    # and the loss is the whole-row labels path's (a causal model's first SEQ outputs do not see the last id).
    model, rows = make_model(), batch(4, seed=5)
    fed = []
    model.model.register_forward_pre_hook(lambda mod, args: fed.append(tuple(args[0].shape)))
    m = step(model, [rows], adamw(model, lr=0.0), lr=0.0)
    assert fed == [(4, SEQ)] and m.tokens == 4 * SEQ
    with torch.no_grad():
        torch.testing.assert_close(m.lm_loss, model(rows, labels=rows).loss, rtol=1e-6, atol=1e-6)


def test_wrap_ddp_makes_the_gradients_views_of_its_buckets(tmp_path):
    # gradient_as_bucket_view: the gradients live in DDP's buckets (no copy into them and back each step), so far
    # fewer storages than parameters hold them; the step is the unwrapped model's.
    from minilm.trainer import wrap_ddp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        plain, wrapped = make_model(), wrap_ddp(make_model(), torch.device("cpu"))
        steps = [step(model, [batch(4, seed=6)]) for model in (plain, wrapped)]
        wrapped(batch(2, seed=7)[:, :-1], targets=batch(2, seed=7)[:, 1:]).loss.backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in wrapped.module.parameters()}
        inner = wrapped.module
        del wrapped  # DDP's reducer goes while its group lives: gloo's destructor can hang after the group is gone
    finally:
        leave_process_group()
    assert len(storages) < len(list(inner.parameters())) // 4
    torch.testing.assert_close(steps[1].loss, steps[0].loss)
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), inner.parameters(), strict=True))


# ---- no_sync, prepare_model, configure_backends -----------------------------------------------------

class CountingNoSync(torch.nn.Module):
    """A model with DDP's no_sync() that counts the micro-steps it covered."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.skipped_syncs = inner, 0

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def no_sync(self):
        self.skipped_syncs += 1
        return contextlib.nullcontext()


def test_no_sync_on_all_micro_steps_but_the_last():
    model = CountingNoSync(make_model())
    step(model, batch(8, seed=1).split(2))
    assert model.skipped_syncs == 3


@pytest.mark.parametrize("use_moe", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_gives_the_same_step(use_moe, dtype):
    """Recomputing each block in backward changes memory, not results: same loss, same gradients, bit for bit
    (dropout on: the recompute replays the RNG)."""
    grads = []
    for checkpointing in (False, True):
        model = make_model(use_moe=use_moe, dropout=0.1)
        assert prepare_model(model, TrainConfig(activation_checkpointing=checkpointing), "cpu") is model
        opt = adamw(model)
        seen = []
        opt.register_step_pre_hook(
            lambda o, a, k, seen=seen: seen.extend(p.grad.clone() for g in o.param_groups for p in g["params"]))
        torch.manual_seed(7)
        m = step(model, batch(4, seed=2).split(2), opt, dtype=dtype)
        grads.append((m.loss, seen, list(model.state_dict())))
    (loss_a, grads_a, keys_a), (loss_b, grads_b, keys_b) = grads
    assert torch.equal(loss_a, loss_b) and keys_a == keys_b
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_activation_checkpointing_is_off_in_eval_and_generation():
    model = make_model()
    prepare_model(model, TrainConfig(activation_checkpointing=True), "cpu")
    ids = batch(1, seed=3)[:, :5]
    reference = make_model().eval()
    torch.testing.assert_close(model.eval().generate(ids, max_new_tokens=4, temperature=0),
                               reference.generate(ids, max_new_tokens=4, temperature=0))


def test_speed_options_are_validated_and_configure_backends_is_a_cpu_no_op():
    assert TrainConfig().compile == "off" and TrainConfig().activation_checkpointing is False
    assert TrainConfig(compile="yes").problems() == ["compile must be one of off, blocks, model, got 'yes'"]
    problems = TrainConfig(activation_checkpointing=1).problems()
    assert any("activation_checkpointing must be true or false" in p for p in problems)
    before = torch.get_float32_matmul_precision()
    configure_backends("cpu")
    assert torch.get_float32_matmul_precision() == before


def test_importing_the_model_leaves_torch_dynamo_unloaded_and_compiling_keeps_the_experts_eager():
    """torch._dynamo costs ~1 s of CPU at import: every Ray worker and rank imports the model, few compile. The
    experts' eager mark is applied when prepare_model compiles (their slices have data-dependent sizes)."""
    probe = "import sys, minilm.model, ray_jobs.worker; print('torch._dynamo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]

    model = make_model()
    prepare_model(model, TrainConfig(compile=True), "cpu")  # block.compile() is lazy: nothing compiles until a forward
    assert getattr(MoEFeedForward._dispatch, "_torchdynamo_disable", False)


@pytest.fixture
def a_hopper_gpu(monkeypatch):
    """configure_backends' view of a CUDA GPU of compute capability 9.0, on this CPU machine; the process-wide
    precision settings it changes are restored afterwards."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_configure_backends_tf32_reads_the_same_through_the_legacy_and_the_new_getters(a_hopper_gpu):
    # Inductor's autotuning reads the legacy getters; after torch >= 2.9's fp32_precision setters they raise.
    configure_backends("cuda")
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 is True and torch.backends.cudnn.allow_tf32 is True
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_never_picks_emulated_bf16(monkeypatch, native):
    # V100 / T4: torch.cuda.is_bf16_supported() is True by emulation (slow); auto picks fp16 there.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    assert resolve_dtype("auto", "cuda") == (torch.bfloat16 if native else torch.float16)
