"""Train in this process, without Ray: the same `minilm.trainer.Trainer` the Ray job runs on every worker.

    python -m minilm.train --data data/tok --max-steps 200 --run-dir runs/local1     # checkpoints, resume
    torchrun --nproc-per-node 2 -m minilm.train --data data/tok --run-dir runs/ddp1  # plain DDP
    python -m minilm.train --random-tokens 200000 --max-steps 20                     # synthetic ids, timing
    python -m minilm.train --tokens ids.npy --seq-len 128 --max-steps 50             # a .npy of token ids

Every ModelConfig / TrainConfig field and run option (minilm.options) is a flag, as for
`ray_jobs.pretrain`; without --data the demo preset applies. With --run-dir, checkpoints go to
RUN_DIR/checkpoint_<step> and `--resume auto` (the default) continues the newest complete one, at any
world size that keeps the global batch. The flags every command shares: minilm.cli.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as C
from . import data as D
from .cli import ArgumentParser, command, fail
from .config import OPTIMIZERS, ConfigError, ModelConfig, TrainConfig
from .distributed import (
    Collectives,
    collective_failure,
    collective_timeout_s,
    init_from_torchrun,
    leave_process_group,
)
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError
from .options import RunOptions, add_run_flags, build_configs, load_yaml, option
from .rows import rows_note
from .run import DRY_RUN, Launch, RunPlan, check_run, claim
from .step import TORCH_DTYPES, NonFiniteLossError, cuda_alloc_env, resolve_auto
from .testing import from_env as hooks_from_env
from .trackers import TrackerError
from .trainer import Dataset, Preempted, Trainer


@dataclass
class LocalOptions(RunOptions):
    """minilm.train's own flags: data without Ray Data, and where the run folder is."""

    tokens: str | None = option(help="a .npy file of 1-D token ids (instead of --data)")
    random_tokens: int | None = option(help="train on this many uniformly random token ids (instead of --data)",
                                       minimum=1)
    run_dir: str | None = option(help="the run folder: checkpoints, metrics.jsonl and world_size.csv go here "
                                      "(default: none kept)")


class LocalLauncher:
    """Batches read in this process; checkpoints renamed into a local run folder; SIGTERM as the stop flag."""

    def __init__(self, data: Dataset, micro_batch_size: int, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", run_dir: str | os.PathLike | None = None, say=print):
        self.data, self.micro_batch_size = data, micro_batch_size
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.storage, self.say, self.sigterm = C.LocalStorage(run_dir), say, False  # say: a line for a person

    def batches(self, order: D.RankOrder, total_steps: int) -> D.LocalRankStream:
        return D.LocalRankStream(self.data.store, order, total_steps, self.micro_batch_size, self.device)

    def stop_flags(self) -> tuple[bool, bool]:
        return self.sigterm, False


def sequences_from_tokens(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """Cut a 1-D array of token ids into (N, seq_len + 1) rows (the tail that does not fill a row is dropped)."""
    n = len(tokens) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens do not fill one sequence of seq_len + 1 = {seq_len + 1}")
    return torch.as_tensor(np.asarray(tokens[: n * (seq_len + 1)], dtype=np.int64).reshape(n, seq_len + 1))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m minilm.train", description=__doc__.split("\n")[0], epilog=__doc__)
    p.add_argument("--config", help="YAML file of option: value (any flag below; default: none)")
    add_run_flags(p, LocalOptions)
    return p


@command()
def main(argv: list[str] | None = None) -> int:
    os.umask(0o027)  # run folders and checkpoints: readable by their owner and group only
    try:
        return run_cli(argv)
    finally:
        leave_process_group()


class RefusedOnRank0(UsageError):
    """Rank 0 refused the run (and said why): the other ranks leave with the same exit code, silently."""


class LocalLaunch(Launch):
    """minilm.train's side of the run plan: data read in this process, a local run folder, torchrun's world size."""

    def __init__(self, world_size: int):
        self.world_size, self.device = world_size, torch.device("cpu")  # torchrun's device, once its group is up

    def check(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: LocalOptions) -> None:
        if sum(x is not None for x in (opts.data, opts.tokens, opts.random_tokens)) != 1:
            raise UsageError("give the data to train on: one of --data DIR, --tokens FILE.npy or --random-tokens N")
        run_dir = Path(opts.run_dir).resolve() if opts.run_dir else None
        opts.run_dir = str(run_dir) if run_dir else None
        opts.name = opts.name or (run_dir.name if run_dir else "local")

    def open_data(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: LocalOptions, notes: list) -> Dataset:
        if opts.data:
            prepared = D.open_local(opts.data)  # a remote URI is copied to this node once, as for ray_jobs.pretrain
            notes += [D.fit_configs(prepared, model_cfg, train_cfg, opts.from_manifest),
                      rows_note(prepared.manifest, opts.data)]
            return Dataset.prepared(prepared)
        if opts.tokens:
            path = Path(opts.tokens)
            if not path.is_file():
                raise UsageError(f"--tokens {path}: file not found")
            ids = np.load(path)  # allow_pickle is off: never code from the file
            if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise UsageError(f"--tokens {path}: expected a .npy file of a 1-D array of integer token ids")
            lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)  # checked once here, not per batch
            if lo < 0 or hi >= model_cfg.vocab_size:
                raise UsageError(f"--tokens {path}: token id {lo if lo < 0 else hi} is outside the vocabulary "
                                 f"[0, {model_cfg.vocab_size})")
            rows = sequences_from_tokens(ids, train_cfg.seq_len)
        else:
            if not 0 < opts.random_tokens <= 1 << 30:  # held in memory as int64: past 8 GB it is a typo
                raise UsageError(f"--random-tokens must be in [1, 2**30], got {opts.random_tokens}")
            rng = np.random.default_rng(train_cfg.seed)
            rows = sequences_from_tokens(rng.integers(0, model_cfg.vocab_size, opts.random_tokens), train_cfg.seq_len)
        return Dataset.in_memory(rows.numpy())

    def world_sizes(self, opts: LocalOptions) -> range:
        return range(self.world_size, self.world_size + 1)

    def folder(self, opts: LocalOptions) -> C.RunFolder | None:
        return C.RunFolder(opts.run_dir) if opts.run_dir else None

    def resolve(self, plan: RunPlan) -> None:  # on rank 0, which hands its answer to the others (agreed_auto)
        plan.opts.optimizer_why = resolve_auto(plan.model_cfg, plan.train_cfg, self.device, self.world_size)


def start(argv: list[str] | None) -> tuple[Trainer | None, RunPlan]:
    """Flags -> a Trainer at its first step (rank 0 holding the run folder's lease), or None after --dry-run's checks;
    every user error raises."""
    started_at = time.time()
    if torch.cuda.is_available():  # before anything starts CUDA, whose allocator reads its settings once
        os.environ.update(cuda_alloc_env())
    signal.signal(signal.SIGTERM, interrupt)  # until the loop reads its stop flag, a SIGTERM ends the start at once
    args = build_parser().parse_args(argv)
    file_values = load_yaml(args.config)
    configs = build_configs(args, file_values, LocalOptions, demo=not (args.data or file_values.get("data")))
    configs.run.started_at = started_at
    hooks = hooks_from_env(warn=lambda m: print(m, file=sys.stderr))
    launch = LocalLaunch(int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1)
    plan = check_run(configs, launch)  # before torchrun's process group: a refused run needs no peers
    rank, world_size, device = init_from_torchrun(timeout_s=plan.opts.collective_timeout_s)
    say = lambda m: print(m, flush=True)  # noqa: E731
    refused, launch.device = None, device
    if rank == 0:
        try:
            claim(plan, launch, say)
        except (UsageError, C.CheckpointError) as e:
            refused = e
    elif plan.opts.resume not in ("auto", "never"):
        plan.opts.resume_path = str(Path(plan.opts.resume).expanduser().resolve())
    if world_size > 1 and Collectives(device).broadcast_from_rank0(torch.tensor([refused is not None]))[0]:
        raise refused or RefusedOnRank0("")
    if refused is not None:
        raise refused
    if plan.opts.dry_run:  # every check passed (rank 0's under torchrun): no Trainer
        if rank == 0:
            say(DRY_RUN)
        return None, plan
    train_cfg = plan.train_cfg
    if world_size > 1:
        agreed_auto(train_cfg, device)
    launcher = LocalLauncher(plan.data, train_cfg.micro_batch_size, rank=rank, world_size=world_size, device=device,
                             run_dir=plan.run_dir, say=say)
    if rank == 0:
        for note in plan.notes:
            print(note, flush=True)
    try:
        trainer = Trainer(plan.model_cfg, train_cfg, plan.opts, plan.data, launcher, hooks=hooks, steps=plan.steps)
    except BaseException:
        plan.release()
        raise
    signal.signal(signal.SIGTERM, lambda *_: setattr(launcher, "sigterm", True))  # a checkpoint at the step, then exit
    return trainer, plan


def interrupt(*_) -> None:
    """SIGTERM before the first step (a tracker that does not answer, a download): nothing is half-written, so the
    process ends now, as Ctrl-C does: one line, exit 130."""
    raise KeyboardInterrupt


def run_cli(argv: list[str] | None) -> int:
    """Parse, check, train; every user error is one line and an exit code."""
    try:
        trainer, plan = start(argv)
        if trainer is None:  # --dry-run
            return 0
    except RefusedOnRank0:
        return EXIT_USAGE
    except (UsageError, ConfigError, D.DataError, C.CheckpointError, TrackerError, ValueError, FileNotFoundError) as e:
        return fail(str(e))
    except (MemoryError, RuntimeError) as e:  # a config that checks out but whose model does not fit here
        if not isinstance(e, MemoryError) and "alloc" not in str(e):
            raise
        return fail(f"the run does not fit in this machine's memory: {type(e).__name__}: {str(e).strip()[:160]}")
    outcome, t0, opts = "failed", time.time(), plan.opts
    rank, world_size, device = trainer.rank, trainer.world_size, trainer.device
    try:
        outcome = trainer.fit()
    except KeyboardInterrupt:
        return fail("interrupted; continue with --resume auto and the same --run-dir", EXIT_INTERRUPTED)
    except (Preempted, NonFiniteLossError, C.CheckpointError) as e:
        return fail(f"training stopped: {e}", EXIT_FAILED)
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError among them) are RuntimeErrors
        line = collective_failure(e, collective_timeout_s(device.type, opts.collective_timeout_s), rank,
                                  world_size) if world_size > 1 else None
        if line is None:
            raise
        return fail(f"training failed: {line}", EXIT_FAILED)
    finally:
        trainer.close(outcome)
        plan.release()
    if rank == 0:
        last = trainer.history[-1] if trainer.history else None
        print(f"done: {outcome} at optimizer step {trainer.step}/{trainer.total_steps} in {time.time() - t0:.1f}s"
              + (f", final loss {last['loss']:.4f}" if last else ""), flush=True)
    return 0


def agreed_auto(train_cfg: TrainConfig, device: torch.device) -> None:
    """Under torchrun, rank 0's dtype and optimizer (it resolved "auto" in the claim) become every rank's."""
    dtypes, optimizers = list(TORCH_DTYPES), list(OPTIMIZERS)
    known = "auto" not in (train_cfg.dtype, train_cfg.optimizer)  # always on rank 0
    codes = [dtypes.index(train_cfg.dtype), optimizers.index(train_cfg.optimizer)] if known else [0, 0]
    dtype, optimizer = Collectives(device).broadcast_from_rank0(torch.tensor(codes, device="cpu")).tolist()
    train_cfg.dtype, train_cfg.optimizer = dtypes[dtype], optimizers[optimizer]


def exit_process(code: int) -> None:
    """A torchrun rank of several leaves without interpreter finalization, during which a gloo thread that outlived
    the process group would abort the process (SIGABRT: a failed run for torchrun); its files are closed by then."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
