"""What a checkpoint costs training, against model size, as the Trainer takes one (`minilm.checkpoint
.CheckpointManager`: resume files + weights export, published into a run folder): the training thread's stall,
sync vs async (and the async writer's time), a restore, and their share of training time at a CPU step and at a
stated GPU step. bench/README.md has the details. Writes checkpoint.json."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minilm import checkpoint as C
from minilm.config import TrainConfig
from minilm.step import make_grad_scaler, optimizer_step
from ray_jobs.cli import DEMO_PRESET

from .common import add_model_args, build, environment, machine, model_config, synchronize, table, write_json

TARGET, STALL_GOAL, SHARE_GOAL = 0.02, 0.10, 0.01  # sync save / CPU training, async / sync stall, async / GPU


def parse_size(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected HIDDENxLAYERS, e.g. 512x8") from None
    return hidden, layers


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_size(hidden: int, layers: int, args, root: Path) -> dict:
    """At one size: an optimizer step on a fixed batch, then sync and async checkpoints alternated `--repeats` times
    (the first async one, which allocates the reused snapshot buffers, apart), then a restore of the last."""
    device = torch.device(args.device)
    cfg = model_config(argparse.Namespace(**{**vars(args), "hidden_size": hidden, "num_hidden_layers": layers}))
    model, optimizer = build(cfg, TrainConfig(optimizer="adamw", lr=1e-4), device)
    scaler = make_grad_scaler(torch.float32, device.type)
    batch = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(2):  # the first also allocates AdamW's state; the second counts
        t0 = time.perf_counter()
        float(optimizer_step(model, optimizer, scaler, [batch], lr=1e-4, grad_clip=1.0).loss)
        step_s = time.perf_counter() - t0
    state, steps = {"optimizer_step": 1, "model_config": cfg.to_dict(), "note": "bench.checkpoint"}, itertools.count(1)
    folders = {mode: root / f"h{hidden}-l{layers}-{mode}" for mode in ("sync", "async")}  # each keeping one
    writers = {mode: C.CheckpointManager(C.LocalStorage(folder), TrainConfig(checkpoint_mode=mode), rank=0,
                                         device=device, keep=1, export=C.WeightsExport(cfg), say=lambda m: None)
               for mode, folder in folders.items()}

    def save(mode: str) -> tuple[float, float]:
        folders[mode].mkdir(exist_ok=True)
        t0 = time.perf_counter()
        writers[mode].report(next(steps), {}, model=model, optimizer=optimizer, scaler=scaler, state=state)
        synchronize(device)  # on a GPU the snapshot's copies hold the stream: they count as the stall
        stall = time.perf_counter() - t0
        writers[mode].wait()
        return stall, time.perf_counter() - t0

    first_async = save("async")[0]
    timed = [(save("sync")[0], *save("async")) for _ in range(args.repeats)]
    sync_s, async_s, write_s = (statistics.median(x) for x in zip(*timed, strict=True))
    t0, published = time.perf_counter(), max(folders["sync"].glob("checkpoint_*"))
    resume = C.load_resume_state(published)  # the hashes checked, then loaded into the model and its optimizer
    model.load_state_dict(resume.model_state, strict=True)
    optimizer.load_state_dict(resume.optimizer_state)
    scaler.load_state_dict(resume.scaler_state)
    restore_s = time.perf_counter() - t0
    window = args.checkpoint_every * args.gpu_step_s
    async_cost = async_s + max(0.0, write_s - window)  # a write longer than the interval makes the next save wait
    return {"hidden_size": hidden, "num_hidden_layers": layers, "params": model.num_params(), "step_s": step_s,
            "resume_bytes": folder_bytes(published) - folder_bytes(published / "weights"),
            "export_bytes": folder_bytes(published / "weights"), "save_s": sync_s, "restore_s": restore_s,
            "sync_stall_s": sync_s, "async_stall_s": async_s, "async_first_stall_s": first_async,
            "async_write_s": write_s, "stall_ratio": async_s / sync_s, "stall_s_all": timed,
            "checkpoint_fraction": sync_s / (sync_s + args.checkpoint_every * step_s),
            "sync_share": sync_s / (sync_s + window), "async_share": async_cost / (async_cost + window)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__)
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(256, 4), (512, 8), (768, 16)],
                   help="HIDDENxLAYERS ... (default: 256x4 512x8 768x16)")
    add_model_args(p, ("vocab_size", "seq_len", "micro_batch_size", "checkpoint_every", "repeats"),
                   seq_len=DEMO_PRESET["seq_len"], micro_batch_size=DEMO_PRESET["micro_batch_size"],
                   checkpoint_every=TrainConfig.checkpoint_every, repeats=2)
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--gpu-step-s", type=float, default=0.2, help="the stated GPU step of the GPU share")
    p.add_argument("--device", default="cpu", help="where the model trains (cuda: pinned snapshot buffers)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    env = environment()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.dir) as tmp:
        rows = [bench_size(h, n, args, Path(tmp)) for h, n in args.sizes]
    every, gpu_s = args.checkpoint_every, args.gpu_step_s
    print(f"{machine(env)}; checkpoints in {args.dir or tempfile.gettempdir()}\n# stall = the training thread's time "
          f"per checkpoint (sync: the whole save), median of {args.repeats}; write = the async writer's time; restore "
          f"= the hash check and load_state_dict; share = save / (save + {every} x step), the step on {args.device} "
          f"({args.micro_batch_size} x {args.seq_len} tokens) or a stated GPU step of {gpu_s} s")
    print(table(["size", "params", "resume MB", "export MB", "sync s", "async s", "ratio", "1st async", "write s",
                 "restore s", "step s", "share", "GPU sync", "GPU async"], [
        [f"{r['hidden_size']}x{r['num_hidden_layers']}", f"{r['params'] / 1e6:.1f}M", f"{r['resume_bytes'] / 1e6:.1f}",
         f"{r['export_bytes'] / 1e6:.1f}", *(f"{r[k]:.3f}" for k in ("sync_stall_s", "async_stall_s")),
         f"{r['stall_ratio']:.1%}", *(f"{r[k]:.3f}" for k in ("async_first_stall_s", "async_write_s", "restore_s",
                                                                "step_s")),
         *(f"{r[k]:.2%}" for k in ("checkpoint_fraction", "sync_share", "async_share"))] for r in rows]))
    for r in rows:
        size = f"{r['hidden_size']}x{r['num_hidden_layers']}"
        print(f"checkpoint cost ({size}, {r['params'] / 1e6:.1f}M params): {r['checkpoint_fraction']:.2%} of training "
              f"time at checkpoint_every {every} (target < {TARGET:.0%})"
              + ("" if r["checkpoint_fraction"] < TARGET else "  ABOVE TARGET"))
        print(f"async stall ({size}): {r['stall_ratio']:.1%} of the sync save (goal < {STALL_GOAL:.0%})"
              f"{'' if r['stall_ratio'] < STALL_GOAL else '  ABOVE GOAL'}; share {r['async_share']:.2%} at a {gpu_s} s "
              f"step (goal < {SHARE_GOAL:.0%})" + ("" if r["async_share"] < SHARE_GOAL else "  ABOVE GOAL"))
    write_json("checkpoint.json", {"args": {**vars(args), "sizes": [list(s) for s in args.sizes]},
                                   "environment": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
