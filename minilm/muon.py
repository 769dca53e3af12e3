"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer.

Muon replaces the SGD momentum of a 2-D weight's gradient by the nearest semi-orthogonal matrix
before the step, so every direction of the matrix moves at the same rate. The embedding, norm gains
and MoE router stay on AdamW, as in the public Muon recipes. One optimizer holding both kinds of
group (`group["use_muon"]`) keeps a checkpoint to one `optimizer.pt`.

The update is deterministic (a fixed bf16 Newton-Schulz), so every DDP rank computes the same one;
`optimizer.found_inf` (1.0 = skip), as GradScaler sets it for fused AdamW, skips a step with
`torch.where`, bitwise and without a host sync.
"""

from __future__ import annotations

import torch

# Quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T: in 5 steps these
# coefficients make a normalised matrix orthogonal enough for an update direction, far cheaper than an SVD.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T of g = U S V^T (g 2-D), by `steps` Newton-Schulz iterations.

    In bf16 on every device: precise enough for a direction, these matmuls are Muon's whole cost, and
    one dtype everywhere keeps every rank's update the same.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16)
    wide = x.shape[0] > x.shape[1]
    if wide:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if wide else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on groups with `use_muon=True`, decoupled-weight-decay AdamW on the others.

    Group keys: `lr`, `lr_ratio` (see `minilm.step.set_lr`), `weight_decay`, and for Muon groups
    `momentum`, `nesterov`, `ns_steps`; for AdamW groups `betas`, `eps`.
    """

    def __init__(self, params, lr: float, *, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0):
        defaults = {"lr": lr, "lr_ratio": 1.0, "weight_decay": weight_decay, "use_muon": False,
                    "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps, "betas": tuple(betas), "eps": eps}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D weight matrices only")

    # torch's amp protocol (as fused AdamW): GradScaler and minilm.step.step_unless_nonfinite hand `found_inf`
    # (and `grad_scale`) over as attributes for one step and delete them after it.
    _step_supports_amp_scaling = True

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch keeps a loaded "step" where it was loaded (CPU); AdamW's step counter lives on the parameter's device.
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("Muon takes unscaled gradients: call scaler.unscale_(optimizer) before the step")
        skip = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon_step(p, group, skip)
                else:
                    self._adamw_step(p, group, skip)
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf, g, beta, lr = state["momentum_buffer"], p.grad, group["momentum"], group["lr"]
        new_buf = buf.lerp(g, 1 - beta)  # EMA of the gradient
        direction = g.lerp(new_buf, beta) if group["nesterov"] else new_buf
        update = orthogonalize(direction, group["ns_steps"])
        # A tall matrix's orthogonal update has entries ~1/sqrt(cols): scale it up so tall and wide
        # matrices move their outputs alike.
        update = update * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
        new_p = p * (1 - lr * group["weight_decay"]) - lr * update
        _commit(buf, new_buf, skip)
        _commit(p, new_p, skip)

    def _adamw_step(self, p: torch.Tensor, group: dict, skip: torch.Tensor | None) -> None:
        state = self.state[p]
        if not state:
            # A tensor step (like torch's AdamW with capturable/fused): it counts without a host sync.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        (beta1, beta2), lr, g = group["betas"], group["lr"], p.grad
        step = state["step"] + 1
        exp_avg = state["exp_avg"].lerp(g, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"] * beta2 + (1 - beta2) * g * g
        bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = (exp_avg_sq / bias2).sqrt() + group["eps"]
        new_p = p * (1 - lr * group["weight_decay"]) - lr * (exp_avg / bias1) / denom
        _commit(state["step"], step, skip)
        _commit(state["exp_avg"], exp_avg, skip)
        _commit(state["exp_avg_sq"], exp_avg_sq, skip)
        _commit(p, new_p, skip)


def _commit(old: torch.Tensor, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """old <- new, or old unchanged where skip is 1 (selected, not blended: NaN in `new` cannot leak)."""
    if skip is None:
        old.copy_(new)
    else:
        old.copy_(torch.where(skip > 0, old, new))


def muon_param_groups(model: torch.nn.Module, *, lr: float, muon_lr: float, weight_decay: float) -> list[dict]:
    """Groups for `Muon`: block matrices on Muon, other matrices (embedding / head, router) on AdamW with
    decay, vectors (norm gains) on AdamW without.

    Muon's decoupled decay uses weight_decay / lr_ratio, so lr x decay per step is the same for
    every matrix whichever optimizer moves it.
    """
    muon, adam_decay, adam_no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and ".layers." in f".{name}" and not name.endswith("mlp.gate.weight"):
            muon.append(p)
        elif p.dim() >= 2:
            adam_decay.append(p)
        else:
            adam_no_decay.append(p)
    ratio = muon_lr / lr
    return [
        {"params": muon, "use_muon": True, "lr_ratio": ratio, "weight_decay": weight_decay / ratio},
        {"params": adam_decay, "lr_ratio": 1.0, "weight_decay": weight_decay},
        {"params": adam_no_decay, "lr_ratio": 1.0, "weight_decay": 0.0},
    ]


__all__ = ["Muon", "orthogonalize", "muon_param_groups", "NS_COEFFICIENTS"]
