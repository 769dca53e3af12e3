"""The Ray Train parts of bench.overhead: part 2, 2 DDP workers on 2 CPUs (scaling efficiency and the all-reduce's
share, with and without no_sync), and part 3, how long ray.train.report blocks against the time between reports."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.step import TORCH_DTYPES, make_grad_scaler, make_optimizer, optimizer_step

# ---- part 2: 2 DDP workers on 2 CPUs ----------------------------------------------------------------

def ddp_models(model_cfg: ModelConfig, cfg: TrainConfig) -> list[tuple]:
    """(model, optimizer) of the single worker, of DDP, and of DDP whose comm hook leaves the gradients as they are
    (the compute alone); the same weights on both ranks, as the job has."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def local_only(_state, bucket):
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    models = []
    for wrap in (None, "ddp", "compute"):
        torch.manual_seed(cfg.seed)
        model = MiniMindForCausalLM(model_cfg).train()
        optimizer = make_optimizer(model, cfg)
        if wrap:
            model = DDP(model)
            if wrap == "compute":
                model.register_comm_hook(None, local_only)
        models.append((model, optimizer))
    return models


def ddp_rounds(config: dict) -> None:
    """Ray Train worker function of part 2 (both ranks); reports rank 0's step times per variant."""
    import ray.train
    import torch.distributed as dist

    torch.set_num_threads(1)  # 1 CPU per worker
    rank, world = dist.get_rank(), dist.get_world_size()
    model_cfg, cfg = ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"])
    dtype = TORCH_DTYPES[config["dtype"]]
    scaler = make_grad_scaler(dtype, "cpu")

    (single, single_opt), (synced, synced_opt), (compute, compute_opt) = ddp_models(model_cfg, cfg)

    gen = torch.Generator().manual_seed(1)  # the same batches on both ranks; each takes its slice
    G, m = cfg.global_batch_size, cfg.micro_batch_size
    batches = [torch.randint(0, model_cfg.vocab_size, (G, cfg.seq_len + 1), generator=gen)
               for _ in range(config["rounds"] + config["warmup"])]

    def timed(fn, *args, **kwargs) -> float:
        dist.barrier()  # both ranks start together; the wait for the other rank is not timed
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        dist.barrier()
        return elapsed

    def step(model, optimizer, micro_batches, no_sync: bool = True) -> None:
        if not no_sync:  # DDP's no_sync() shadowed by a no-op: every micro-step's backward all-reduces
            model.no_sync = contextlib.nullcontext
        try:
            m = optimizer_step(model, optimizer, scaler, micro_batches, lr=1e-4, grad_clip=1.0, dtype=dtype)
        finally:
            model.__dict__.pop("no_sync", None)
        float(m.loss)

    def alone(micro_batches) -> None:  # rank 0 does the whole batch; rank 1 only meets it at the barriers
        if rank == 0:
            step(single, single_opt, micro_batches)

    times = {"single": [], "ddp_no_sync": [], "ddp_sync_every_micro_step": [], "ddp_no_allreduce": []}
    for i, batch in enumerate(batches):
        mine = list(batch.chunk(world)[rank].split(m))
        round_times = {
            "single": timed(alone, list(batch.split(m))),
            "ddp_no_sync": timed(step, synced, synced_opt, mine),
            "ddp_sync_every_micro_step": timed(step, synced, synced_opt, mine, no_sync=False),
            "ddp_no_allreduce": timed(step, compute, compute_opt, mine),
        }
        if i >= config["warmup"]:
            for k, v in round_times.items():
                times[k].append(v)
    metrics = {"times": times, "rank": rank, "accumulation": len(mine), "world_size": world}
    # Ray Train v2 hands the driver only metrics that come with a checkpoint: rank 0 attaches a tiny one.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            Path(tmp, "times.json").write_text(json.dumps(times))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def two_workers(args, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict:
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {"model": model_cfg.to_dict(), "train": train_cfg.to_dict(), "dtype": args.dtype,
              "rounds": args.rounds, "warmup": 1}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer(ddp_rounds, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               run_config=RunConfig(name="overhead-ddp", storage_path=tmp,
                                                    logging_config=LoggingConfig(log_level="WARNING")),
                               torch_config=TorchConfig(backend="gloo"))
        result = trainer.fit()
    times = result.metrics["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = train_cfg.global_batch_size * train_cfg.seq_len
    return {"step_s_median": med, "step_s_all": times, "tokens_per_s": {k: tokens / v for k, v in med.items()},
            "accumulation_per_rank": result.metrics["accumulation"],
            "scaling_efficiency": med["single"] / (2 * med["ddp_no_sync"]),
            "scaling_efficiency_without_no_sync": med["single"] / (2 * med["ddp_sync_every_micro_step"]),
            "allreduce_share": 1 - med["ddp_no_allreduce"] / med["ddp_no_sync"],
            "allreduce_share_without_no_sync": 1 - med["ddp_no_allreduce"] / med["ddp_sync_every_micro_step"],
            "no_sync_speedup": med["ddp_sync_every_micro_step"] / med["ddp_no_sync"]}


# ---- part 3: how long ray.train.report blocks, against the time between reports ---------------------------

REPORT_INTERVALS_S = (0.05, 0.2, 0.5, 1.0, 2.0, 3.0)


def report_rounds(config: dict) -> None:
    """Ray Train worker function of part 3: sleep for a log interval (the steps between two reports), then time
    `ray.train.report` of a metrics dict the size of the loop's; hand the times back in a checkpoint."""
    import ray.train

    metrics = {key: 1.0 for key in ("loss", "lm_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu",
                                    "samples_seen", "tokens_seen", "eta_s", "data_wait_frac", "checkpoint_s")}
    times: dict[str, list[float]] = {}
    for interval in config["intervals"]:
        times[str(interval)] = []
        for i in range(config["reports"]):
            time.sleep(interval)
            t0 = time.perf_counter()
            ray.train.report({**metrics, "optimizer_step": i})
            times[str(interval)].append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "times.json").write_text(json.dumps(times))
        ray.train.report({"done": 1}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def report_blocking(args) -> dict:
    """Part 3 twice, side by side: Ray Train's controller polling at Ray's default (2 s) and at the job's own
    setting (ray_jobs.pretrain.CONTROLLER_POLL_S), unless --ray-poll-interval names one to compare instead."""
    from ray_jobs.pretrain import CONTROLLER_POLL_ENV, CONTROLLER_POLL_S

    polls = {"ray_default": "2", "minilm": str(args.ray_poll_interval or CONTROLLER_POLL_S)}
    before = os.environ.get(CONTROLLER_POLL_ENV)
    results = {}
    try:
        for label, poll in polls.items():
            os.environ[CONTROLLER_POLL_ENV] = poll  # Ray hands it from this process to the controller at fit()
            results[label] = {"poll_s": float(poll), "rows": report_rows(args)}
    finally:
        if before is None:
            os.environ.pop(CONTROLLER_POLL_ENV, None)
        else:
            os.environ[CONTROLLER_POLL_ENV] = before
    return results


def report_rows(args) -> list[dict]:
    from ray.train import LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    config = {"intervals": list(args.report_intervals), "reports": args.reports}
    with tempfile.TemporaryDirectory() as tmp:
        result = TorchTrainer(report_rounds, train_loop_config=config,
                              scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
                              run_config=RunConfig(name="overhead-report", storage_path=tmp,
                                                   logging_config=LoggingConfig(log_level="WARNING")),
                              torch_config=TorchConfig(backend="gloo")).fit()
        times = json.loads(Path(result.checkpoint.path, "times.json").read_text())
    rows = []
    for interval, t in times.items():
        blocked = statistics.median(t[1:])  # the first follows another interval's reports
        rows.append({"interval_s": float(interval), "report_s_median": blocked, "report_s_all": t,
                     "throughput_factor": float(interval) / (float(interval) + blocked)})
    return rows


def print_report_blocking(part3: dict) -> None:
    default, ours = part3["ray_default"], part3["minilm"]
    print(f"part 3: ray.train.report after each log interval, 1 worker; Ray Train's controller polling every "
          f"{default['poll_s']:g} s (Ray's default) and every {ours['poll_s']:g} s (the job's), one after the other")
    print(f"{'interval s':>10}{'report s':>10}{'steps get':>11}{'report s':>10}{'steps get':>11}{'ratio':>8}")
    for a, b in zip(default["rows"], ours["rows"], strict=True):
        print(f"{a['interval_s']:>10.2f}{a['report_s_median']:>10.3f}{a['throughput_factor']:>11.1%}"
              f"{b['report_s_median']:>10.3f}{b['throughput_factor']:>11.1%}"
              f"{b['throughput_factor'] / a['throughput_factor']:>7.2f}x")
    print("steps get = interval / (interval + report): the share of wall time left to training when the loop reports "
          "that often; ratio: the job's setting over Ray's default")


def print_ddp(part2: dict, args) -> None:
    med, tps = part2["step_s_median"], part2["tokens_per_s"]
    labels = {"single": "1 worker x 1 CPU (whole batch)",
              "ddp_no_sync": "2 workers x 1 CPU, no_sync (default)",
              "ddp_sync_every_micro_step": "2 workers x 1 CPU, all-reduce every micro-step",
              "ddp_no_allreduce": "2 workers x 1 CPU, no all-reduce (compute)"}
    print(f"{'part 2: ' + str(args.rounds) + ' rounds, median':<50}{'step s':>8}{'tokens/s':>10}")
    for k, label in labels.items():
        print(f"{label:<50}{med[k]:>8.3f}{tps[k]:>10,.0f}")
    print(f"scaling efficiency, 2 workers vs 1 (1 CPU each): {part2['scaling_efficiency']:.1%} with no_sync, "
          f"{part2['scaling_efficiency_without_no_sync']:.1%} without")
    print(f"all-reduce share of step time: {part2['allreduce_share']:.1%} with no_sync, "
          f"{part2['allreduce_share_without_no_sync']:.1%} without ({part2['accumulation_per_rank']} micro-steps "
          f"per rank); no_sync makes the step {part2['no_sync_speedup']:.2f}x faster")
