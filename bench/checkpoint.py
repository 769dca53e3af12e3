"""Checkpoint save and restore time vs model size, and checkpointing's share of training time.

    python -m bench.checkpoint                         # 3 sizes: the demo preset, MiniMind 26M, MiniMind 104M
    python -m bench.checkpoint --mode stall            # the training thread's stall per checkpoint, sync vs async

bench/README.md has the details. Writes checkpoint.json or checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from minilm import checkpoint as C
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step
from ray_jobs.cli import DEMO_PRESET

from .common import add_model_args, environment, synchronize, write_json

TARGET = 0.02


def parse_size(text: str) -> tuple[int, int]:
    try:
        hidden, layers = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected HIDDENxLAYERS, e.g. 512x8") from None
    return hidden, layers


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_and_step(hidden: int, layers: int, args, device: torch.device):
    """(config, model, optimizer, scaler, step): step() runs one optimizer step on a fixed batch, its seconds."""
    cfg = ModelConfig(hidden_size=hidden, num_hidden_layers=layers, vocab_size=args.vocab_size,
                      max_position_embeddings=args.seq_len + 1)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(cfg).to(device).train()
    optimizer = make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4))
    scaler = make_grad_scaler(torch.float32, device.type)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen).to(device)

    def step() -> float:
        t0 = time.perf_counter()
        float(optimizer_step(model, optimizer, scaler, [batch], lr=1e-4, grad_clip=1.0).loss)
        return time.perf_counter() - t0
    return cfg, model, optimizer, scaler, step


def bench_size(hidden: int, layers: int, args, root: Path) -> dict:
    cfg, model, optimizer, scaler, step = model_and_step(hidden, layers, args, torch.device("cpu"))
    step_times = [step(), step()]  # the first step also allocates AdamW's state; the second is the one that counts
    step_s = step_times[1]
    state = {"optimizer_step": 1, "model_config": cfg.to_dict(), "note": "bench.checkpoint"}

    saves, exports, restores, sizes = [], [], [], {}
    for k in range(args.repeats):
        path = root / f"h{hidden}-l{layers}-{k}"
        t0 = time.perf_counter()
        C.save_resume_state(path, model=model, optimizer=optimizer, scaler=scaler, state=state)
        t1 = time.perf_counter()
        C.export_weights(path / "weights", model, cfg)
        t2 = time.perf_counter()
        saves.append(t1 - t0)
        exports.append(t2 - t1)
        sizes = {"resume_bytes": folder_bytes(path) - folder_bytes(path / "weights"),
                 "export_bytes": folder_bytes(path / "weights")}
        t0 = time.perf_counter()
        resume = C.load_resume_state(path)
        model.load_state_dict(resume.model_state, strict=True)
        optimizer.load_state_dict(resume.optimizer_state)
        scaler.load_state_dict(resume.scaler_state)
        restores.append(time.perf_counter() - t0)
        del resume
        shutil.rmtree(path, ignore_errors=True)
    save_s = statistics.median(s + e for s, e in zip(saves, exports, strict=True))
    fraction = save_s / (save_s + args.checkpoint_every * step_s)
    return {"hidden_size": hidden, "num_hidden_layers": layers, "params": model.num_params(), **sizes,
            "save_resume_s": statistics.median(saves), "export_s": statistics.median(exports), "save_s": save_s,
            "restore_s": statistics.median(restores), "save_s_all": [s + e for s, e in zip(saves, exports, strict=True)],
            "restore_s_all": restores, "step_s": step_s, "first_step_s": step_times[0],
            "tokens_per_step": args.micro_batch_size * args.seq_len, "checkpoint_fraction": fraction}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(256, 4), (512, 8), (768, 16)],
                   help="HIDDENxLAYERS ... (default: 256x4 512x8 768x16)")
    add_model_args(p, ("vocab_size", "seq_len", "micro_batch_size"), seq_len=DEMO_PRESET["seq_len"],
                   micro_batch_size=DEMO_PRESET["micro_batch_size"])
    p.add_argument("--checkpoint-every", type=int, default=DEMO_PRESET["checkpoint_every"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--mode", choices=["save", "stall"], default="save",
                   help="save: save/restore time and share (default); stall: sync vs async stall per checkpoint")
    p.add_argument("--gpu-step-s", type=float, default=0.2, help="--mode stall: the GPU step time of the share")
    p.add_argument("--device", default="cpu", help="--mode stall: where the model trains (cuda: pinned snapshots)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.mode == "stall":
        given = argv if argv is not None else sys.argv[1:]
        if "--sizes" not in given:
            args.sizes = [(512, 8), (768, 16)]
        if "--checkpoint-every" not in given:
            args.checkpoint_every = 100
        if "--micro-batch-size" not in given:
            args.micro_batch_size = 2  # CPU steps short enough for several of them to run during a write
        return stall_main(args)

    env, rows = bench_sizes(bench_size, args)
    print(f"# save = save_resume_state + export_weights; restore = load_resume_state (hash check) + load_state_dict; "
          f"median of {args.repeats}; step = optimizer step of {args.micro_batch_size} x {args.seq_len} tokens")
    header = (f"{'size':<8} {'params':>8} {'resume MB':>10} {'export MB':>10} {'save s':>8} {'restore s':>10} "
              f"{'step s':>8} {'share':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        size = f"{r['hidden_size']}x{r['num_hidden_layers']}"
        print(f"{size:<8} {r['params'] / 1e6:>7.1f}M {r['resume_bytes'] / 1e6:>10.1f} "
              f"{r['export_bytes'] / 1e6:>10.1f} {r['save_s']:>8.3f} {r['restore_s']:>10.3f} {r['step_s']:>8.3f} "
              f"{r['checkpoint_fraction']:>7.2%}")
    print(f"share = save / (save + {args.checkpoint_every} x step): the cost of one checkpoint every "
          f"{args.checkpoint_every} optimizer steps")
    for r in rows:
        verdict = "" if r["checkpoint_fraction"] < TARGET else "  ABOVE TARGET"
        print(f"checkpoint cost ({r['hidden_size']}x{r['num_hidden_layers']}, {r['params'] / 1e6:.1f}M params): "
              f"{100 * r['checkpoint_fraction']:.2f}% of training time at checkpoint_every {args.checkpoint_every} "
              f"(target < {100 * TARGET:.0f}%){verdict}")
    path = write_json("checkpoint.json", {"args": {**vars(args), "sizes": [list(s) for s in args.sizes]},
                                          "environment": env, "rows": rows})
    print(f"wrote {path}")
    return 0


STALL_GOAL, SHARE_GOAL = 0.10, 0.01


def bench_stall(hidden: int, layers: int, args, root: Path) -> dict:
    """Sync vs async stall of the training thread per checkpoint at one size, and tokens/s with a save in flight."""
    device = torch.device(args.device)
    cfg, model, optimizer, scaler, step = model_and_step(hidden, layers, args, device)
    step()  # AdamW's state exists from here on
    state = {"optimizer_step": 1, "model_config": cfg.to_dict(), "note": "bench.checkpoint --mode stall"}
    # each mode's own run folder, keeping one checkpoint: what the Trainer's manager does at a checkpoint step
    writers = {mode: C.CheckpointManager(C.LocalStorage(root / f"h{hidden}-l{layers}-{mode}"),
                                         TrainConfig(checkpoint_mode=mode), rank=0, device=device, keep=1,
                                         export=C.WeightsExport(cfg), say=lambda m: None) for mode in ("sync", "async")}
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    writes, saves = [], itertools.count(1)  # the step each save reports

    def start(writer: C.CheckpointManager) -> None:
        writer.report(next(saves), {}, model=model, optimizer=optimizer, scaler=scaler, state=state)

    def save(mode: str) -> tuple[float, float]:
        writer = writers[mode]
        (root / f"h{hidden}-l{layers}-{mode}").mkdir(exist_ok=True)
        t0 = time.perf_counter()
        start(writer)
        synchronize(device)  # on a GPU the snapshot's copies hold the stream: they count as the stall
        stall = time.perf_counter() - t0
        writer.wait()
        return stall, time.perf_counter() - t0

    first_async = save("async")[0]  # allocates the reused buffers
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            stall, done = save(mode)
            stalls[mode].append(stall)
            writes += [done] if mode == "async" else []

    tokens = args.micro_batch_size * args.seq_len
    during, after = in_flight_steps(writers["async"], start, step, args.repeats)
    sync_s, async_s, write_s = (statistics.median(x) for x in (stalls["sync"], stalls["async"], writes))
    window = args.checkpoint_every * args.gpu_step_s
    async_cost = async_s + max(0.0, write_s - window)  # a write longer than the interval makes the next save wait
    return {"hidden_size": hidden, "num_hidden_layers": layers, "params": model.num_params(),
            "sync_stall_s": sync_s, "async_stall_s": async_s, "async_first_stall_s": first_async,
            "async_write_s": write_s, "stall_ratio": async_s / sync_s,
            "sync_stall_s_all": stalls["sync"], "async_stall_s_all": stalls["async"],
            "tokens_per_s_in_flight": tokens * len(during) / sum(during),
            "tokens_per_s_without": tokens * len(after) / sum(after), "steps_in_flight": len(during),
            "cpu_step_s": statistics.median(after),
            "sync_share": sync_s / (sync_s + window), "async_share": async_cost / (async_cost + window)}


def in_flight_steps(writer, start, step, repeats: int) -> tuple[list[float], list[float]]:
    """The seconds of steps run while an async save is written, and of as many steps right after it, alternately."""
    during, after = [], []
    for _ in range(repeats):
        start(writer)
        times = []
        while not writer.pending.done() or not times:
            times.append(step())
        writer.wait()
        during += times
        after += [step() for _ in range(len(times))]
    return during, after


def bench_sizes(bench, args) -> tuple[dict, list[dict]]:
    """(environment, rows): `bench(hidden, layers, args, folder)` for each of --sizes in one temporary folder; prints
    the machine line."""
    env = environment()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.dir) as tmp:
        rows = [bench(hidden, layers, args, Path(tmp)) for hidden, layers in args.sizes]
    print(f"# {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
          f"load average {env['load_average']}; checkpoints in {args.dir or tempfile.gettempdir()}")
    return env, rows


def stall_main(args) -> int:
    env, rows = bench_sizes(bench_stall, args)
    print(f"# stall = the training thread's time per checkpoint (resume files + weights export), median of "
          f"{args.repeats}, sync and async alternated; write = the async writer's time to COMPLETE.json and weights/")
    header = (f"{'size':<8} {'params':>8} {'sync s':>8} {'async s':>8} {'ratio':>7} {'1st async':>9} "
              f"{'write s':>8} {'tok/s saving':>12} {'tok/s not':>10} {'sync share':>10} {'async share':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        size = f"{r['hidden_size']}x{r['num_hidden_layers']}"
        print(f"{size:<8} {r['params'] / 1e6:>7.1f}M {r['sync_stall_s']:>8.3f} {r['async_stall_s']:>8.3f} "
              f"{r['stall_ratio']:>7.1%} {r['async_first_stall_s']:>9.3f} {r['async_write_s']:>8.3f} "
              f"{r['tokens_per_s_in_flight']:>12.0f} {r['tokens_per_s_without']:>10.0f} {r['sync_share']:>10.2%} "
              f"{r['async_share']:>11.2%}")
    print(f"share = stall / (stall + {args.checkpoint_every} x {args.gpu_step_s} s): a GPU step of {args.gpu_step_s} s "
          f"(stated, not measured), one checkpoint every {args.checkpoint_every} steps; tok/s on {args.device}, "
          f"micro-batch {args.micro_batch_size} x {args.seq_len}")
    for r in rows:
        size = f"{r['hidden_size']}x{r['num_hidden_layers']}"
        print(f"async stall ({size}): {r['stall_ratio']:.1%} of the sync save (goal < {STALL_GOAL:.0%})"
              f"{'' if r['stall_ratio'] < STALL_GOAL else '  ABOVE GOAL'}; share {r['async_share']:.2%} at a "
              f"{args.gpu_step_s} s step (goal < {SHARE_GOAL:.0%}){'' if r['async_share'] < SHARE_GOAL else '  ABOVE GOAL'}; "
              f"tokens/s with a save in flight {r['tokens_per_s_in_flight'] / r['tokens_per_s_without']:.0%} of without")
    path = write_json("checkpoint_stall.json", {"args": {**vars(args), "sizes": [list(s) for s in args.sizes]},
                                                "environment": env, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
