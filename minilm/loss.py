"""The language-model head and its loss, chunked: the whole batch's fp32 logits never exist at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Positions whose fp32 logits exist at once in the chunked head and loss (`head_loss`): ~128 MB at vocab 6400.
HEAD_CHUNK_LOGITS = 2**25


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: autocast's where it is on, else x's own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Cross entropy of the logits `hidden @ weight.T` against `targets` (-100: none), chunk by chunk: the mean, or
    (reduction "none") each position's nats. With gradients, `HeadLoss` computes them in the forward."""
    h, t = hidden.flatten(0, 1), targets.flatten()
    rows = max(1, HEAD_CHUNK_LOGITS // weight.shape[0])
    if reduction == "mean" and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return HeadLoss.apply(h, weight, t, rows)
    nats = torch.cat([F.cross_entropy(F.linear(hc, weight).float(), tc, ignore_index=-100, reduction="none")
                      for hc, tc in zip(h.split(rows), t.split(rows), strict=True)])
    return nats.view(targets.shape) if reduction == "none" else nats.sum() / (t != -100).sum()


class HeadLoss(torch.autograd.Function):
    """The mean next-token loss of the head over chunks of `rows` positions; the gradients (softmax - one-hot,
    through the head's two matmuls) are computed in the forward, chunk by chunk, and only scaled in backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, rows):
        dtype = compute_dtype(h)
        w = weight.to(dtype)  # as autocast casts the head's weight
        grad_h = torch.empty(h.shape, dtype=dtype, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for hc, tc, gc in zip(h.split(rows), targets.split(rows), grad_h.split(rows), strict=True):
            hc = hc.to(dtype)
            logits = (hc @ w.T).float()
            keep = tc != -100
            safe = tc.masked_fill(~keep, 0)[:, None]
            lse = logits.logsumexp(-1)
            total += ((lse - logits.gather(1, safe)[:, 0]) * keep).sum()
            # softmax - one-hot; a row without a target gets exp(-inf) = 0 everywhere
            g = (logits - lse.masked_fill(~keep, float("inf"))[:, None]).exp_()
            g = g.scatter_add_(1, safe, -keep[:, None].float()).to(dtype)
            gc.copy_(g @ w)
            grad_w += (g.T @ hc).float()
        count = (targets != -100).sum()
        ctx.save_for_backward(grad_h, grad_w, count)
        ctx.h_dtype, ctx.w_dtype = h.dtype, weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad / count
        return (grad_h.float() * scale).to(ctx.h_dtype), (grad_w * scale).to(ctx.w_dtype), None, None
