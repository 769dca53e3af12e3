"""The MiniMind architecture: shapes, causality, attention against a plain reference, MoE routing and
aux loss, MiniMind state-dict names, KV-cache generation, parameter and FLOP counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import bitwise_equal
from torch.utils._python_dispatch import TorchDispatchMode

from minilm import loss
from minilm import model as M
from minilm.config import ModelConfig
from minilm.model import Attention, MiniMindForCausalLM, MoEFeedForward, rope_tables

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
            max_position_embeddings=512)


def make_model(seed: int = 0, **kw) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    return MiniMindForCausalLM(ModelConfig(**{**TINY, **kw}))


# ---- shapes and loss ------------------------------------------------------------------------------

@pytest.mark.parametrize("use_moe", [False, True])
def test_output_shapes_and_loss(use_moe):
    model = make_model(use_moe=use_moe).train()
    ids = torch.randint(0, 256, (3, 17))
    out = model(ids, labels=ids)
    assert out.logits.shape == (3, 17, 256)
    assert out.loss.shape == () and out.aux_loss.shape == ()
    assert out.past_key_values is None
    # Labels are shifted inside: position t predicts token t+1.
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert model(ids).loss is None

    # -100 positions are ignored.
    labels = ids.clone()
    labels[:, 9:] = -100
    expected = F.cross_entropy(out.logits[:, :8].reshape(-1, 256).float(), ids[:, 1:9].reshape(-1))
    torch.testing.assert_close(model.eval()(ids, labels=labels).loss, expected)

    cached = model(ids, use_cache=True).past_key_values
    assert len(cached) == 2
    k, v = cached[0]
    assert k.shape == v.shape == (3, 17, 4, 8)  # (batch, seq, kv heads, head_dim)


@pytest.mark.parametrize("use_moe", [False, True])
def test_causal_mask(use_moe):
    model = make_model(use_moe=use_moe).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        base = model(ids).logits
        for t in (0, 5, 14):
            changed = ids.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % 256
            logits = model(changed).logits
            torch.testing.assert_close(logits[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(logits[:, t + 1], base[:, t + 1], atol=1e-4)  # the change is visible


# ---- attention against a plain reference ----------------------------------------------------------

def reference_attention(attn: Attention, x: torch.Tensor, theta: float, eps: float) -> torch.Tensor:
    """Textbook GQA attention in float64 from the module's own weights: q/k RMSNorm, rotate-half
    RoPE, each kv head repeated for its group of query heads, softmax with a -inf causal mask."""
    x = x.double()
    b, t, _ = x.shape
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    wq, wk, wv, wo = (m.weight.double() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))

    def rms(v, w):
        return w.double() * v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)

    q = rms((x @ wq.T).view(b, t, nh, d), attn.q_norm.weight)
    k = rms((x @ wk.T).view(b, t, nkv, d), attn.k_norm.weight)
    v = (x @ wv.T).view(b, t, nkv, d)

    def rope(z):
        out = torch.empty_like(z)
        half = d // 2
        for pos in range(t):
            for i in range(half):
                angle = pos * theta ** (-2.0 * i / d)
                c, s = math.cos(angle), math.sin(angle)
                x1, x2 = z[:, pos, :, i], z[:, pos, :, i + half]
                out[:, pos, :, i] = x1 * c - x2 * s
                out[:, pos, :, i + half] = x2 * c + x1 * s
        return out

    q, k = rope(q), rope(k)
    group = nh // nkv
    k = torch.stack([k[:, :, h // group] for h in range(nh)], dim=2)  # repeat kv heads
    v = torch.stack([v[:, :, h // group] for h in range(nh)], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, nh * d)
    return y @ wo.T


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (4, 4), (8, 2)])
def test_attention_matches_reference(heads, kv_heads):
    cfg = ModelConfig(**{**TINY, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rope_theta": 1e4})
    torch.manual_seed(0)
    attn = Attention(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains so the q/k norms are really checked
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 11, cfg.hidden_size)
    cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    y, _ = attn(x, cos[:11], sin[:11])
    expected = reference_attention(attn, x, cfg.rope_theta, cfg.rms_norm_eps)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-5)


def test_model_uses_its_rope_tables():
    model = make_model(rope_theta=10000.0)
    cos, sin = rope_tables(8, 512, 10000.0)
    assert torch.equal(model.model.freqs_cos, cos) and torch.equal(model.model.freqs_sin, sin)


# ---- the step built for a GPU: chunked head and loss, residual dtype, SDPA's GQA ----------------------------

class LargestLogits(TorchDispatchMode):
    """The most elements of any fp32 tensor over the vocabulary (logits, their softmax or gradient) an op made,
    forward and backward, while active."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.numel = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == self.vocab:
                self.numel = max(self.numel, t.numel())
        return out


def test_targets_give_the_labels_loss_and_gradients_without_the_batch_logits(monkeypatch):
    V = 320  # a vocabulary unlike any other width of the model
    # Rows of seq_len + 1 ids: row[:, :-1] fed, row[:, 1:] scored (-100 ignored), the head in chunks of 10
    # positions with its gradients computed in the forward: the loss and every gradient of the whole-row labels path,
    # and no fp32 tensor as large as the batch's logits (4 x 32 positions x V) ever exists.
    monkeypatch.setattr(loss, "HEAD_CHUNK_LOGITS", 10 * V)
    model = make_model(vocab_size=V, tie_word_embeddings=False).train()
    rows = torch.randint(0, V, (4, 33), generator=torch.Generator().manual_seed(3))
    labels = rows.clone()
    labels[1, 5:9] = -100
    grads = {}
    for path in ("labels", "targets"):
        with LargestLogits(V) as largest:
            out = model(rows, labels=labels) if path == "labels" else model(rows[:, :-1], targets=labels[:, 1:])
            out.loss.backward()
        grads[path] = (out.loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, largest.numel)
        model.zero_grad()
    (loss_a, grad_a, big_a), (loss_b, grad_b, big_b) = grads["labels"], grads["targets"]
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    for k in grad_a:
        torch.testing.assert_close(grad_b[k], grad_a[k], rtol=1e-5, atol=1e-7)
    assert big_a >= 4 * 32 * V > big_b
    with torch.no_grad(), LargestLogits(V) as largest:  # per-position nats (validation, bits per byte), also chunked
        nats = model(rows[:, :-1], targets=rows[:, 1:], reduction="none").loss
    assert nats.shape == (4, 32) and largest.numel < 4 * 32 * V
    want = F.cross_entropy(model(rows).logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(nats.flatten(), want, rtol=1e-5, atol=1e-6)


def test_the_residual_stream_is_in_autocast_dtype():
    # Under bf16 autocast every block reads and writes a bf16 residual stream (the embedding's fp32 output is cast
    # once); without autocast it stays fp32. The loss moves by bf16 rounding only.
    model = make_model().train()
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(4))
    fp32 = model(ids[:, :-1], targets=ids[:, 1:]).loss
    assert seen == [torch.float32] * 2
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(ids[:, :-1], targets=ids[:, 1:]).loss
    assert seen == [torch.bfloat16] * 2
    torch.testing.assert_close(bf16, fp32, rtol=1e-2, atol=0)


@pytest.mark.parametrize("document_mask", [False, True])
def test_grouped_query_heads_are_read_in_place_by_sdpa(monkeypatch, document_mask):
    # 8 query heads on 2 kv heads: without a mask SDPA's enable_gqa reads the shared heads (no copy of K and V);
    # with the document mask K and V are still repeated (some torch versions' masked kernels refuse GQA). The
    # output is the repeated path's either way.
    calls = []
    repeat = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: calls.append(1) or repeat(*a, **k))
    model = make_model(num_attention_heads=8, num_key_value_heads=2, document_mask=document_mask).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    ids[:, 7] = model.config.eos_token_id
    with torch.no_grad():
        native = model(ids).logits
        assert len(calls) == (4 if document_mask else 0) and M.SDPA_GQA  # K and V in each of 2 layers
        monkeypatch.setattr(M, "SDPA_GQA", False)
        copied = model(ids).logits
    assert len(calls) == 8 if document_mask else len(calls) == 4
    torch.testing.assert_close(native, copied, rtol=1e-5, atol=1e-6)


# ---- MoE ------------------------------------------------------------------------------------------

def routed_moe(coef: float = 0.1, norm_topk_prob: bool = True):
    """4 experts, top-1, gate = 2 * identity on the first 4 hidden dims: a token equal to basis
    vector e_i goes to expert i with known probabilities."""
    cfg = ModelConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, use_moe=True, num_experts=4,
                      num_experts_per_tok=1, router_aux_loss_coef=coef, intermediate_size=32,
                      norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    moe = MoEFeedForward(cfg).train()
    with torch.no_grad():
        moe.gate.weight.zero_()
        for e in range(4):
            moe.gate.weight[e, e] = 2.0
    routes = [0, 0, 1, 2, 0, 1]  # expert 3 receives no token
    x = torch.zeros(1, len(routes), 16)
    for n, e in enumerate(routes):
        x[0, n, e] = 1.0
    return moe, x, routes


def test_moe_aux_loss_hand_computed():
    coef = 0.1
    moe, x, routes = routed_moe(coef)
    moe(x)
    n, num_experts = len(routes), 4
    # softmax of a logit vector with one entry 2 and three entries 0
    p_hi = math.exp(2) / (math.exp(2) + 3)
    p_lo = 1 / (math.exp(2) + 3)
    load = [routes.count(e) / n for e in range(num_experts)]  # [3/6, 2/6, 1/6, 0]
    mean_prob = [(routes.count(e) * p_hi + (n - routes.count(e)) * p_lo) / n for e in range(num_experts)]
    expected = num_experts * coef * sum(f * p for f, p in zip(load, mean_prob, strict=True))
    assert moe.aux_loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(moe.expert_load, torch.tensor(load))

    moe.eval()
    moe(x)
    assert moe.aux_loss.item() == 0.0  # no load balancing bookkeeping in eval


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_top1_output_is_the_expert_weighted_by_its_prob_or_with_norm_topk_prob_by_one_as_minimind(norm_topk_prob):
    moe, x, routes = routed_moe(norm_topk_prob=norm_topk_prob)
    y = moe(x)
    weight = 1.0 if norm_topk_prob else math.exp(2) / (math.exp(2) + 3)
    for n, e in enumerate(routes):
        torch.testing.assert_close(y[0, n], weight * moe.experts[e](x[0, n]))


def test_moe_gradients_reach_router_and_every_expert():
    moe, x, routes = routed_moe()
    (moe(x).square().sum() + moe.aux_loss).backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    for e, expert in enumerate(moe.experts):
        for name, p in expert.named_parameters():
            assert p.grad is not None, (e, name)  # DDP needs a grad for every parameter
            if e in routes:
                assert p.grad.abs().sum() > 0, (e, name)
            else:
                assert torch.equal(p.grad, torch.zeros_like(p)), (e, name)  # idle expert: zero, not None

    # The aux loss alone trains the router.
    moe.zero_grad(set_to_none=True)
    moe(x)
    moe.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0


def test_aux_loss_zero_for_dense_eval_and_zero_coef():
    ids = torch.randint(0, 256, (2, 9))
    assert make_model().train()(ids, labels=ids).aux_loss.item() == 0.0
    moe = make_model(use_moe=True, router_aux_loss_coef=0.01)
    assert moe.train()(ids, labels=ids).aux_loss.item() > 0
    assert moe.eval()(ids, labels=ids).aux_loss.item() == 0.0
    assert make_model(use_moe=True, router_aux_loss_coef=0.0).train()(ids, labels=ids).aux_loss.item() == 0.0
    load = moe.expert_load()
    assert load.shape == (2, 4) and torch.allclose(load.sum(-1), torch.ones(2))
    assert make_model().expert_load() is None


def test_moe_model_trains_all_parameters():
    model = make_model(use_moe=True).train()
    ids = torch.randint(0, 256, (2, 9))
    out = model(ids, labels=ids)
    (out.loss + out.aux_loss).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# ---- state dict -----------------------------------------------------------------------------------

def expected_keys(layers: int, use_moe: bool, experts: int = 4) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(layers):
        p = f"model.layers.{i}."
        keys |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if use_moe:
            keys.add(p + "mlp.gate.weight")
            keys |= {p + f"mlp.experts.{e}.{n}.weight" for e in range(experts)
                     for n in ("gate_proj", "up_proj", "down_proj")}
        else:
            keys |= {p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    return keys


@pytest.mark.parametrize("use_moe", [False, True])
def test_state_dict_keys_are_minimind_names(use_moe):
    sd = make_model(use_moe=use_moe).state_dict()
    assert set(sd) == expected_keys(2, use_moe)
    assert not any("freqs" in k or "expert_load" in k for k in sd)  # rope tables are buffers, not weights


@pytest.mark.parametrize("use_moe", [False, True])
def test_state_dict_round_trip_strict(use_moe):
    a, b = make_model(0, use_moe=use_moe).eval(), make_model(1, use_moe=use_moe).eval()
    ids = torch.randint(0, 256, (2, 12))
    assert not torch.equal(a(ids).logits, b(ids).logits)
    result = b.load_state_dict(a.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert b.lm_head.weight is b.model.embed_tokens.weight  # still tied after loading


# ---- generation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("use_moe", [False, True])
def test_kv_cache_generate_matches_full_recompute(use_moe):
    model = make_model(3, use_moe=use_moe).eval()
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (2, 5))
    cached = model.generate(prompt, max_new_tokens=12, temperature=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, ids)


def test_cache_with_multi_token_chunk_matches_full_forward():
    model = make_model(5).eval()
    ids = torch.randint(0, 256, (2, 14))
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :6], use_cache=True)
        second = model(ids[:, 6:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, rtol=1e-5, atol=1e-5)


def test_generate_stops_at_eos_and_max_positions():
    model = make_model(6, max_position_embeddings=10).eval()
    prompt = torch.randint(0, 256, (1, 4))
    assert model.generate(prompt, max_new_tokens=50, temperature=0).shape[1] == 10
    first = model.generate(prompt, max_new_tokens=1, temperature=0)[0, -1].item()
    out = model.generate(prompt, max_new_tokens=20, temperature=0, eos_token_id=first)
    assert out.shape[1] == 5


# ---- sizes and FLOPs ------------------------------------------------------------------------------

def test_num_params_total_and_active():
    dense, moe = make_model(), make_model(use_moe=True, num_experts=4, num_experts_per_tok=1)
    h, inter, layers, vocab, heads, kv, d = 64, 256, 2, 256, 8, 4, 8
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 2 * d + 2 * h + 3 * h * inter
    assert dense.num_params() == vocab * h + layers * per_layer + h  # tied embedding counted once
    assert dense.num_params(active=True) == dense.num_params()
    per_expert, gate = 3 * h * inter, 4 * h
    assert moe.num_params() == dense.num_params() + layers * (3 * per_expert + gate)
    assert moe.num_params(active=True) == dense.num_params() + layers * gate  # top-1 of 4: one expert active
    top2 = make_model(use_moe=True, num_experts=4, num_experts_per_tok=2)
    assert top2.num_params(active=True) == dense.num_params() + layers * (per_expert + gate)


def test_flops_and_mfu():
    dense, moe = make_model(), make_model(use_moe=True)
    f = dense.flops_per_token(128)
    assert f > 0
    assert dense.flops_per_token(256) - f == 12 * 2 * 64 * 128  # attention term grows with seq_len
    assert moe.flops_per_token(128) == f + 6 * 2 * 4 * 64  # same active FFN; only the router is extra
    m1 = dense.estimate_mfu(1000.0, 128, 1e12)
    assert m1 > 0
    assert dense.estimate_mfu(3000.0, 128, 1e12) == pytest.approx(3 * m1)
    assert dense.estimate_mfu(1000.0, 128, 2e12) == pytest.approx(m1 / 2)
    assert m1 == pytest.approx(f * 1000.0 / 1e12)


# ---- train / eval mode (why the export switches to eval and back) ------------------------------------

def test_modes_change_forward_not_weights():
    model = make_model(7, use_moe=True, dropout=0.2)
    ids = torch.randint(0, 256, (2, 12))
    model.train()
    train_sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert not torch.equal(a, b)  # dropout is on in train mode: two forwards differ
    assert model.aux_loss().item() > 0  # and the MoE load-balancing loss is computed
    model.eval()
    with torch.no_grad():
        c, d = model(ids).logits, model(ids).logits
    assert torch.equal(c, d) and model.aux_loss().item() == 0.0  # eval: deterministic, no aux bookkeeping
    assert bitwise_equal(train_sd, model.state_dict())  # the weights do not depend on the mode


@pytest.mark.parametrize("start_training", [True, False])
def test_export_reads_weights_in_eval_and_restores_mode(tmp_path, start_training):
    from minilm.checkpoint import export_weights, load_pretrained

    model = make_model(8, use_moe=True).train(start_training)
    modes = []
    original = model.state_dict

    def spy(*args, **kwargs):
        modes.append(model.training)
        return original(*args, **kwargs)

    model.state_dict = spy  # instance attribute: records the mode the export reads the weights in
    export_weights(tmp_path / "w", model, model.config)
    assert modes == [False]
    assert model.training is start_training  # back to train mode (if it was training) for the next step
    loaded, _ = load_pretrained(tmp_path / "w")
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=0, atol=5e-3)  # fp16 export
