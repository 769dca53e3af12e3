"""The MiniMind architecture in plain PyTorch, readable top to bottom; parameter names are MiniMind's, so state
dicts load both ways with `strict=True`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig
from .loss import compute_dtype, head_loss

SDPA_GQA = torch.__version__ >= "2.5"  # scaled_dot_product_attention(..., enable_gqa=True)
PROJECTIONS = "auto"  # "fused" | "split" | "auto": q|k|v and gate|up as one matmul each (`project`), or one per Linear


def project(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """x through each bias-free Linear: one matmul over their weights concatenated, or one matmul each; the
    parameters (state-dict keys, optimizer, exports) are the separate Linears' either way."""
    # "auto" fuses on CUDA only: on CPU the fused step measured 1-3% slower (bench.step, bench/RESULTS.md).
    if PROJECTIONS == "split" or PROJECTIONS == "auto" and not x.is_cuda:
        return tuple(linear(x) for linear in linears)
    weight = torch.cat([linear.weight for linear in linears])
    return F.linear(x, weight).split([linear.out_features for linear in linears], dim=-1)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # None when the loss came from `targets` (`head_loss`: no logits kept)
    loss: torch.Tensor | None  # next-token cross entropy: `labels` shifted inside, or `targets` as given
    aux_loss: torch.Tensor  # MoE load-balancing loss summed over layers; 0 for dense or in eval
    past_key_values: list | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under autocast: the mean of squares underflows in bf16.
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).type_as(x)


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_positions, head_dim), halves duplicated (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat([angles.cos(), angles.cos()], -1), torch.cat([angles.sin(), angles.sin()], -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); cos/sin: (seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    # GQA without a mask: "sdpa" (SDPA's enable_gqa reads the shared K/V heads) or "repeat" (K/V copied per query
    # head, which cuDNN's and the efficient kernels take); "auto": "sdpa" until `resolve_gqa` times both, on CUDA.
    gqa = "auto"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, past_key_value=None, use_cache=False, attn_mask=None):
        b, t, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim))
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=1)
            v = torch.cat([past_key_value[1], v], dim=1)
        present = (k, v) if use_cache else None
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = attn_mask  # causal and within one document (document_mask)
        if past_key_value is not None and t > 1:  # several new tokens after a cache: causal, offset by the cache
            mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - t)
        # GQA: SDPA's own without a mask unless `gqa` is "repeat"; with one, copies of K and V (some torch versions'
        # masked kernels refuse GQA, and SDPA would fall back to its slow math path).
        rep = self.num_heads // self.num_kv_heads
        gqa = {"enable_gqa": True} if rep > 1 and SDPA_GQA and mask is None and self.gqa != "repeat" else {}
        if rep > 1 and not gqa:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = mask is None and past_key_value is None  # one new token after a cache attends to all of it
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                           dropout_p=self.dropout if self.training else 0.0, **gqa)
        y = y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y)), present


def choose_gqa(seconds: Callable[[str], float], rounds: int = 3) -> str:
    """The GQA path ("sdpa" or "repeat") of the lower `seconds(path)`, the best of `rounds`, the paths alternating."""
    best = {"sdpa": math.inf, "repeat": math.inf}
    for _ in range(rounds):
        for path in best:
            best[path] = min(best[path], seconds(path))
    return min(best, key=best.get)


def resolve_gqa(cfg: ModelConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> str:
    """The GQA path a run takes; "auto" resolved once per process on CUDA by timing one attention layer's forward +
    backward at the run's shape (elsewhere nothing is timed). With a mask K and V are always repeated."""
    if cfg.document_mask or not SDPA_GQA:
        return "repeat"
    if Attention.gqa == "auto" and device.type == "cuda" and cfg.num_attention_heads > cfg.num_key_value_heads:
        attn = Attention(cfg).to(device)
        cos, sin = (table.to(device) for table in rope_tables(cfg.head_dim, seq, cfg.rope_theta))
        x = torch.randn(batch, seq, cfg.hidden_size, device=device, requires_grad=True)

        def seconds(path: str) -> float:
            Attention.gqa = path
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                attn(x, cos, sin)[0].sum().backward()
            torch.cuda.synchronize(device)
            return time.perf_counter() - start

        Attention.gqa = choose_gqa(seconds)
    return "sdpa" if Attention.gqa == "auto" else Attention.gqa


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with MiniMind's load-balancing loss.

    Tokens are sorted by expert and each expert runs once on its slice, even an empty one (a zero gradient, so DDP
    needs no find_unused_parameters). "split" cuts the slices by counts read on the host (a sync); "grouped" runs
    each projection as one `torch._grouped_mm` with fixed shapes. "auto" takes "grouped" where that op has its
    sync-free kernel (`grouped_mm_kernel_on`, bf16), else "split"."""

    dispatch = "auto"  # "auto" | "grouped" | "split", for every MoE layer of the process

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob, self.aux_coef = cfg.norm_topk_prob, cfg.router_aux_loss_coef
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(cfg) for _ in range(cfg.num_experts))
        self.aux_loss = torch.zeros(())
        # Share of routed (token, slot) pairs per expert in the last forward: watch for collapse.
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts), persistent=False)
        self.grouped_kernel = False  # whether the weights' device has grouped_mm's sync-free kernel (_apply)

    def _apply(self, fn, recurse=True):
        # Read the device's capability when the module moves, not in forward (a compiled forward would trace it).
        out = super()._apply(fn, recurse)
        self.grouped_kernel = grouped_mm_kernel_on(self.gate.weight.device)
        return out

    def uses_grouped_dispatch(self, x: torch.Tensor) -> bool:
        if self.dispatch != "auto":
            return self.dispatch == "grouped"
        return self.grouped_kernel and compute_dtype(x) == torch.bfloat16

    def forward(self, x):
        b, t, h = x.shape
        x_flat = x.reshape(-1, h)
        probs = F.softmax(self.gate(x_flat), dim=-1, dtype=torch.float32)
        topk_prob, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        # MiniMind's top-1 p / (p + 1e-20) is exactly 1 in math but rounding noise in autograd (which AdamW would
        # amplify): use the 1 it equals. The router learns from the aux loss, as in MiniMind.
        unit_weights = self.norm_topk_prob and self.top_k == 1
        if self.norm_topk_prob and not unit_weights:
            topk_prob = topk_prob / (topk_prob.sum(dim=-1, keepdim=True) + 1e-20)

        dispatch = self._dispatch_grouped if self.uses_grouped_dispatch(x_flat) else self._dispatch
        y, counts = dispatch(x_flat, topk_idx, topk_prob, unit_weights)

        load = counts.float() / x_flat.shape[0]  # tokens routed to each expert, over all slots
        with torch.no_grad():
            self.expert_load.copy_(counts.float() / topk_idx.numel())
        if self.training and self.aux_coef > 0:
            self.aux_loss = self.num_experts * self.aux_coef * (load * probs.mean(0)).sum()
        else:
            self.aux_loss = probs.new_zeros(())
        if unit_weights and torch.is_grad_enabled():
            # The unit weights left the router out of the output's graph; + 0 x (its probabilities)
            # gives it a zero gradient even with router_aux_loss_coef 0, so DDP sees every parameter used.
            self.aux_loss = self.aux_loss + 0 * topk_prob.sum()
        return y.view(b, t, h)

    def _dispatch(self, x_flat, topk_idx, topk_prob, unit_weights: bool):
        """The split dispatch: every (token, slot) pair through its expert, one expert call per slice of the
        sorted pairs; returns (combined output, tokens per expert)."""
        flat_expert = topk_idx.reshape(-1)  # (tokens * top_k,)
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        token_of = order // self.top_k  # source token of each sorted (token, slot) pair
        # index_select, not x_flat[token_of]: its backward is an index_add_, cheaper on CPU than the
        # accumulating index_put_ of advanced indexing (same sums: at most top_k terms per token).
        expert_in = x_flat.index_select(0, token_of)
        outputs = torch.cat([expert(chunk) for expert, chunk in
                             zip(self.experts, expert_in.split(counts.tolist()), strict=True)])
        return self._combine(x_flat, outputs, order, token_of, topk_prob, unit_weights), counts

    def _dispatch_grouped(self, x_flat, topk_idx, topk_prob, unit_weights: bool):
        """`_dispatch`'s sums with no host read: the sorted pairs in a zero-padded buffer of fixed rows, each group
        starting at a multiple of GROUP_ROWS (grouped_mm's alignment); the last group takes the spare rows."""
        e, a = self.num_experts, GROUP_ROWS
        pairs = topk_idx.numel()
        flat_expert = topk_idx.reshape(-1)
        sorted_expert, order = torch.sort(flat_expert, stable=True)
        # bincount's length is data-dependent (a graph break); a scatter into e counters is not
        counts = flat_expert.new_zeros(e).scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        token_of = order // self.top_k
        rows = -(-pairs // a) * a + e * a  # >= the padded groups' total, whatever the routing
        padded = (counts + a - 1) // a * a
        padded[-1:] += rows - padded.sum()
        ends = padded.cumsum(0)
        shift = (ends - padded) - (counts.cumsum(0) - counts)  # each group's padded start minus its start
        slot_of = torch.arange(pairs, device=x_flat.device) + shift[sorted_expert]  # row of each sorted pair
        dtype = compute_dtype(x_flat)
        xs = x_flat.new_zeros(rows, x_flat.shape[1], dtype=dtype).index_copy(
            0, slot_of, x_flat.index_select(0, token_of).to(dtype))
        offs = ends.to(torch.int32)

        def stacked(name):  # (experts, in, out): each nn.Linear's weight, transposed
            return torch.stack([getattr(ex, name).weight.to(dtype) for ex in self.experts]).transpose(-2, -1)

        gate = GroupedMM.apply(xs, stacked("gate_proj"), offs)
        up = GroupedMM.apply(xs, stacked("up_proj"), offs)
        out = GroupedMM.apply(F.silu(gate) * up, stacked("down_proj"), offs)
        outputs = out.index_select(0, slot_of)
        return self._combine(x_flat, outputs, order, token_of, topk_prob, unit_weights), counts

    @staticmethod
    def _combine(x_flat, outputs, order, token_of, topk_prob, unit_weights: bool):
        """The expert outputs of the sorted pairs, weighted and summed back in token order."""
        if unit_weights:
            # Every weight is exactly 1 and each token has one slot: a permutation back to token order, not a sum.
            return outputs.index_select(0, torch.argsort(order))
        weighted = outputs * topk_prob.reshape(-1)[order, None].to(x_flat.dtype)
        return torch.zeros_like(x_flat).index_add_(0, token_of, weighted)


GROUP_ROWS = 8  # rows per group alignment of the grouped dispatch: 16 bytes of bf16


def grouped_mm_kernel_on(device: torch.device) -> bool:
    """Whether torch._grouped_mm has its sync-free bf16 kernel on `device` (CUDA, compute capability 9.x or 10.x:
    the sm90/sm100 test of ATen's _grouped_mm_cuda); anywhere else the op reads its group offsets on the host."""
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


class GroupedMM(torch.autograd.Function):
    """x (rows, in) @ w[g] (in, out) for the rows of each group g (offs: the groups' ends); its own backward, as the
    op's derivative fails on CPU for a gradient with zero strides."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
        grad_w = torch._grouped_mm(x.transpose(0, 1), grad, offs=offs)  # (groups, in, out): each group's x^T grad
        return grad_x, grad_w, None


class MiniMindBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoEFeedForward(cfg) if cfg.use_moe else FeedForward(cfg)

    def forward(self, x, cos, sin, past_key_value=None, use_cache=False, attn_mask=None):
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, past_key_value, use_cache, attn_mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), present


class MiniMindModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(MiniMindBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.register_buffer("freqs_cos", cos, persistent=False)  # not in the state dict, as in MiniMind
        self.register_buffer("freqs_sin", sin, persistent=False)
        # Set by minilm.step.prepare_model: recompute each block in backward (memory down, compute up ~1/3).
        self.activation_checkpointing = False
        self.document_mask = cfg.document_mask
        self.bos_token_id, self.eos_token_id = cfg.bos_token_id, cfg.eos_token_id

    def attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, 1, t, t) bool: causal within each document (one starts at a BOS or right after an EOS)."""
        starts = input_ids == self.bos_token_id
        starts[:, 1:] |= input_ids[:, :-1] == self.eos_token_id
        doc = starts.cumsum(dim=1)
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        start = past_key_values[0][0].shape[1] if past_key_values else 0
        t = input_ids.shape[1]
        cos, sin = self.freqs_cos[start:start + t], self.freqs_sin[start:start + t]
        x = self.dropout(self.embed_tokens(input_ids))
        x = x.to(compute_dtype(x))  # the residual stream in autocast's dtype (an embedding's output is fp32)
        # Generation with a cache reads one document: the plain causal mask is the document mask there.
        mask = self.attention_mask(input_ids) if self.document_mask and not past_key_values else None
        presents = []
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled() and not use_cache
        for i, layer in enumerate(self.layers):
            if recompute:
                # Non-reentrant: it composes with DDP and torch.compile, and replays the RNG (dropout masks match).
                x, present = checkpoint(layer, x, cos, sin, None, False, mask, use_reentrant=False)
            else:
                x, present = layer(x, cos, sin, past_key_values[i] if past_key_values else None, use_cache, mask)
            presents.append(present)
        return self.norm(x), presents


class MiniMindForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig | None = None):
        super().__init__()
        self.config = (config or ModelConfig()).validate()
        self.model = MiniMindModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.weight = self.lm_head.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids, labels=None, past_key_values=None, use_cache=False, targets=None,
                reduction: str = "mean") -> CausalLMOutput:
        """`labels` (MiniMind's): input_ids' positions, shifted inside. `targets`: each position's next token, as given;
        the loss then comes from `head_loss` and no logits come back. -100 marks a position without a target."""
        hidden, presents = self.model(input_ids, past_key_values, use_cache)
        logits = loss = None
        if targets is not None:
            loss = head_loss(hidden, self.lm_head.weight, targets, reduction)
        else:
            logits = self.lm_head(hidden)
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(logits, loss, self.aux_loss(), presents if use_cache else None)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEFeedForward)]

    def aux_loss(self) -> torch.Tensor:
        losses = [m.aux_loss for m in self.moe_layers()]
        return torch.stack(losses).sum() if losses else self.lm_head.weight.new_zeros((), dtype=torch.float32)

    def expert_load(self) -> torch.Tensor | None:
        """(layers, experts) share of routed tokens per expert in the last forward; None for dense."""
        layers = self.moe_layers()
        return torch.stack([m.expert_load for m in layers]) if layers else None

    def num_params(self, active: bool = False) -> int:
        """Unique parameters; with active=True, only the top-k experts' share of each MoE layer."""
        total = sum(p.numel() for p in self.parameters())
        if active and self.config.use_moe:
            per_expert = sum(p.numel() for p in self.moe_layers()[0].experts[0].parameters())
            unused = self.config.num_experts - self.config.num_experts_per_tok
            total -= len(self.moe_layers()) * unused * per_expert
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x active matmul params + attention (PaLM appendix B)."""
        c = self.config
        n = self.num_params(active=True) - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        n += c.vocab_size * c.hidden_size  # the lm_head matmul runs; the embedding lookup does not
        return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len

    def estimate_mfu(self, tokens_per_s: float, seq_len: int, peak_flops: float) -> float:
        return self.flops_per_token(seq_len) * tokens_per_s / peak_flops

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens=64, temperature=0.8, top_p=0.9, eos_token_id=None,
                 generator: torch.Generator | None = None):
        """Sample with a KV cache; temperature 0 is greedy. Returns prompt + continuation."""
        past, ids, x = None, input_ids, input_ids
        for _ in range(max_new_tokens):
            if ids.shape[1] >= self.config.max_position_embeddings:
                break
            out = self(x, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
                drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest set reaching top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                nxt = sorted_i.gather(-1, torch.multinomial(sorted_p, 1, generator=generator))
            ids, x = torch.cat([ids, nxt], dim=1), nxt
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
        return ids
