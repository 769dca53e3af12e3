"""Muon for the hidden weight matrices, AdamW for everything else, in one optimizer (so one `optimizer.pt`); its
update is deterministic, the same on every DDP rank."""

from __future__ import annotations

import torch

# Quintic Newton-Schulz iteration X <- a X + (b A + c A^2) X with A = X X^T: in 5 steps these
# coefficients make a normalised matrix orthogonal enough for an update direction, far cheaper than an SVD.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def native_bf16(device: torch.device | str) -> bool:
    """Whether this device multiplies bf16 matrices in hardware: CUDA, or a CPU with AVX512-BF16 or AMX. Elsewhere bf16
    is emulated, ~10x slower than fp32."""
    if torch.device(device).type == "cuda":
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately U V^T of each matrix g = U S V^T (2-D, or a stack), by `steps` Newton-Schulz iterations in bf16
    where the device has it natively, else fp32: precise enough for a direction, and the same update on every rank."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if native_bf16(g.device) else torch.float32)
    wide = x.shape[-2] > x.shape[-1]
    if wide:  # iterate on the smaller Gram matrix, laid out row-major: a transposed view's matmuls run slower
        x = x.mT.contiguous()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1: in the basin
    # Each sum as one matmul-and-add (addmm): separate scale and add passes cost a CPU half the matmuls' time.
    mm_add = torch.baddbmm if x.dim() == 3 else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm_add(x, mm_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if wide else x).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on groups with `use_muon=True`, decoupled-weight-decay AdamW on the others (`lr_ratio`: step.set_lr)."""

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
    def step(self):
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("Muon takes unscaled gradients: call scaler.unscale_(optimizer) before the step")
        skip = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                self._adamw_step(params, group, skip)
                continue
            # One kind of matrix over all layers at a time: its Newton-Schulz matmuls batched, the rest foreach.
            by_shape: dict[torch.Size, list[torch.Tensor]] = {}
            for p in params:
                by_shape.setdefault(p.shape, []).append(p)
            for same in by_shape.values():
                self._muon_step(same, group, skip)

    def _muon_step(self, params: list[torch.Tensor], group: dict, skip: torch.Tensor | None) -> None:
        """Muon on same-shape matrices: the arithmetic of one matrix, by foreach ops and batched matmuls, in place
        (a fresh tensor of a matrix's size is page-faulted in again on a CPU). A skipped step (`skip` 1, no host
        sync) zeroes the gradients and the step's weights, so momentum and matrices keep their values exactly."""
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        bufs, grads = [self.state[p]["momentum_buffer"] for p in params], [p.grad for p in params]
        beta, lr = group["momentum"], group["lr"]
        ema, decay = 1 - beta, 1 - lr * group["weight_decay"]
        if skip is not None:
            keep = skip > 0
            for g in grads:  # filled, not multiplied: a NaN gradient times 0 is still NaN
                g.masked_fill_(keep, 0.0)
            go = 1 - skip
            ema, lr = go * ema, go * lr
            decay = torch.where(keep, 1.0, torch.full((), decay, device=skip.device))
        torch._foreach_lerp_(bufs, grads, ema)  # EMA of the gradient
        if group["nesterov"]:  # the gradients are not read after the step: they hold the direction
            torch._foreach_lerp_(grads, bufs, beta)
        update = list(orthogonalize(torch.stack(grads if group["nesterov"] else bufs), group["ns_steps"]).unbind(0))
        # A tall matrix's orthogonal update has entries ~1/sqrt(cols): scale it up so tall and wide
        # matrices move their outputs alike.
        scale = max(1.0, params[0].shape[0] / params[0].shape[1]) ** 0.5
        if scale != 1.0:  # x 1.0 would change nothing
            torch._foreach_mul_(update, scale)
        torch._foreach_mul_(update, lr)
        torch._foreach_mul_(params, decay)
        torch._foreach_sub_(params, update)

    def _adamw_step(self, params: list[torch.Tensor], group: dict, skip: torch.Tensor | None) -> None:
        """torch's fused AdamW kernel (minilm.step's AdamW), decoupled decay; `skip` leaves everything as it was."""
        for p in params:
            state = self.state[p]
            if not state:
                # A tensor step (like torch's AdamW with capturable/fused): it counts without a host sync.
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        (beta1, beta2), lr = group["betas"], group["lr"]
        torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
                            found_inf=skip)
        if skip is not None:
            torch._foreach_sub_(steps, [skip] * len(steps))


def muon_param_groups(model: torch.nn.Module, *, lr: float, muon_lr: float, weight_decay: float,
                      embedding_lr_ratio: float) -> list[dict]:
    """Groups for `Muon`: block matrices on Muon; the other matrices (embedding / head, MoE router) on AdamW at lr x
    `embedding_lr_ratio`; vectors on AdamW at lr without decay. Decay is weight_decay / lr_ratio, so lr x decay per
    step is the same for every matrix."""
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
        {"params": adam_decay, "lr_ratio": embedding_lr_ratio, "weight_decay": weight_decay / embedding_lr_ratio},
        {"params": adam_no_decay, "lr_ratio": 1.0, "weight_decay": 0.0},
    ]
