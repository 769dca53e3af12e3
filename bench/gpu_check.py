"""The GPU check: what minilm does on one GPU, in one command that a cold, slow lent machine fits, as one table.

    bash bench/gpu_check.sh --bundle gpu-bundle  # on the lent GPU machine (bench/gpu_bundle.sh built the bundle)
    bash bench/gpu_check.sh --device cpu         # the dry run: CI-sized configs through the same commands
    python -m bench.gpu_check --plan             # the plan alone: every part in order, its limit, the total
    python -m bench.gpu_check --only ray-job,export   # a rerun of some parts (what they need is added)

The lent machine's rules (/work/.library/device/README.md): one H200, 15 minutes of device time per task including
its cold start, 10 minutes per command, Python 3.12 with torch 2.11 and no Ray (the bundle carries it). The budget
(`BUDGET`) is what one command leaves after the bundle's install and the results; the plan, printed first, takes
the parts in order of value while their limits fit within 80% of it (`SPARE`), and says which it leaves for a
rerun (`--only`). Each limit is `MARGIN` x (process start + the part's work + its compilation + a Ray Train
start), from the cold-start assumptions `ASSUME` (GPU: issue #34's reading of a cold preflight; CPU: this
rehearsal's cold start, measured); the first compilation of each block graph is counted cold, later ones from
Inductor's cache. After the preflight (itself the cold start, measured) every later limit is rescaled by how much
slower than assumed it was, and a part that no longer fits is left for a rerun.

Each part is a subprocess in its own process group with its hard limit. In order of value: the parts never run
on a GPU first, then the headline rows, then the refinements (`SPECS`):

  preflight            versions (torch, CUDA, driver, Triton, Ray, numpy, pyarrow), the cold start's phases, and three
                       gates: `import ray.train.torch, ray.data` (a failure skips the Ray parts only), the TF32 getters
                       and a tiny compiled forward+backward (CUDA; a failure skips the compiled rows only), SDPA's
                       flash kernel at the check's shape (CUDA). Only "no CUDA device" stops the check, before any part.
  step-26m-eager       one optimizer step (`minilm.step.optimizer_step`, bf16, dense) timed alone in its own process:
                       MiniMind-26M (hidden 512, 8 layers, micro-batch 32), seq 512: the Trainer's and the Ray job's
                       reference
  ddp1-26m             `python -m bench.gpu_check ddp1`: the 26M model under DDP in a 1-rank NCCL process group (eager,
                       no_sync accumulation, an all-reduce on the device) against the same model without DDP, step by
                       step: the losses must agree (gloo on CPU)
  trainer-ddp1-26m     `python -m bench.gpu_check trainer-ddp1`: minilm's Trainer at the 26M shape (compiled on the GPU),
                       plain, then in a 1-rank NCCL process group with the model DDP-wrapped and the loop's collectives
                       through the group: its tokens/s against the plain Trainer's, and the losses must agree
  moe-26m-compiled     the 26M shape with 4 experts, top-1, compiled: on an sm90 GPU in bf16 the grouped dispatch (no
                       host sync: its graph breaks and recompiles are the dispatch's); the CPU dry run compiles it too
  checkpoint-stall-104m `bench.checkpoint --mode stall` at 104M: the training thread's stall per checkpoint, sync vs
                       async (pinned snapshot buffers on CUDA)
  prepare              the demo corpus through `python -m ray_jobs.prepare` at seq 512
  ray-job, ray-job-resume
                       `python -m ray_jobs.pretrain --use-gpu true --num-workers 1` at the 26M shape, stopped halfway
                       by --exit-after-steps and run again to continue (--resume auto)
  export, sample       `python -m ray_jobs.export` of the last checkpoint, `python -m minilm.sample` from it
  step-104m-compiled, step-26m-compiled
                       the headline rows: MiniMind-104M (hidden 768, 16 layers, micro-batch 128: nanochat's 64k tokens
                       per step) and 26M with `--compile`, plus compile seconds, graph breaks and recompiles (the 26M
                       row adds one step under torch.profiler: its top kernels, flash or not)
  fp16                 `bench.fp16_check`: 50 steps of fp16 with the GradScaler, an overflow injected
  docmask-26m-compiled, muon-26m-compiled, ac-104m-compiled
                       --document-mask, Muon, activation checkpointing at 104M: the paths a run switches on
  step-104m-eager, moe-26m-eager
                       the eager rows
  trainer              `python -m minilm.train` on random tokens at the 26M shape (--val-samples: validation)
  checkpoint-104m      `bench.checkpoint` at 104M: save and restore, their share of wall time at the default
                       checkpoint_every against the 104M step
  stream               the Ray Data stream's delivery rate to the device at seq 512, micro-batch 32: one rank's
                       `ray_jobs.stream.RankStream` (the job's pipeline, pinned async copies) driven alone

The Ray parts share one local Ray that this check starts (or the cluster in RAY_ADDRESS) at its first Ray part
and stops after its last: on 127.0.0.1 (the lent machine has no network to find its address with), a fixed
object store (Ray would size it from the starting MemTotal of a VM whose memory grows as it is used), its
memory monitor off (likewise), as many CPUs as cores, the job's worker 4 of them (`RAY_*` below). The Trainer and
the Ray job are compared with the eager 26M row (same shape, dtype and batch): tokens/s from wall time per step
between their metrics records. Goals (H100/H200-class GPU): 104M compiled >= 45% MFU, 26M compiled >= 30% (MFU
against the data-sheet peak where minilm.progress lists the GPU; `python -m bench.step --estimate h200` predicts
each), the Ray job within 3% of the eager step, the Trainer under DDP in a 1-rank group within 3% of the plain
Trainer; the stream must feed at least the 26M step's tokens/s.

Results: into $OUT when it is set (the lent machine's output folder), else $MINILM_BENCH_RESULTS, else
bench/results/gpu: exactly three files, each rewritten after every part (so a kill loses only the part in
flight): gpu_check.json (the plan, the table, every part's status, limit, wall time and figures),
gpu_check-summary.txt (the table as printed) and gpu_check-logs.tar.gz (logs/<part>.log and results/<part>.json
of every part). Each row is printed the moment its part ends. SIGTERM, SIGINT or SIGHUP (`timeout` in the shell
script) stops the part in flight, writes the three files and stops the Ray this check started; at exit every
part's process group is killed. Exit status 1 if a part failed or timed out or a correctness check (fp16,
resume, export, sample) failed; a goal missed is marked in the table; a part left for a rerun is not a failure.

Code paths that differ on the lent image's torch 2.11 (this machine runs 2.13), each covered by a test:
  - minilm.trainer.wrap_ddp: DDP's `broadcast_buffers=False` (torch < 2.13) instead of `forward_sync_buffers`
    (tests/test_gpu_check.py, test_wrap_ddp_buffer_flag_by_torch_version: both signatures)
  - minilm.step.configure_backends: TF32 through the legacy setters, which torch 2.11 and 2.13 both map onto
    their `fp32_precision` getters (tests/test_step.py, the TF32 getters test on a stand-in capability-9.0 GPU);
    the preflight prints what both getters read on the GPU itself
  - minilm.model.grouped_mm_kernel_on: the MoE layer's grouped dispatch calls the private `torch._grouped_mm`
    (present in 2.11 and 2.13, the same sync-free kernel rules: bf16, sm90/sm100); a torch without it gets the
    split dispatch (tests/test_moe_dispatch.py, test_a_torch_without_grouped_mm_takes_the_split_dispatch). Its
    backward is minilm's own (minilm.model.GroupedMM): the op's derivative (which fails on CPU in 2.13 for a
    zero-stride gradient) is never used
  - minilm.model.Attention: SDPA's `enable_gqa` (torch >= 2.5) on the unmasked path only
The CUDA rules the CPU dry run never meets (an indexed device for torch.cuda.set_device, NCCL's device tensors,
pinned memory for non-blocking copies) are enforced on CPU by tests/cuda_standin.py, under which
tests/test_cuda_rules.py runs the ddp1, trainer-ddp1, row and checkpoint-stall parts with --device cuda.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from minilm.config import TrainConfig

from .common import add_model_args, environment, results_dir

MFU_GOALS = {"26m": 0.30, "104m": 0.45}  # compiled bf16, H100/H200 class (nanochat: ~46% at its d18)
RAY_GOAL = 0.97  # the Ray job's tokens/s over the eager step's, same config
DDP1_GOAL = 0.97  # the Trainer's tokens/s under DDP in a 1-rank group over the plain Trainer's
RAY_MODULES = ("ray", "pyarrow", "tokenizers", "yaml")
FILES = ("gpu_check.json", "gpu_check-summary.txt", "gpu_check-logs.tar.gz")
# Each row: (shape, extra flags of `python -m bench.gpu_check row`, the table's check)
ROWS = {
    "step-26m-eager": ("small", [], "step 26M bf16 eager"),
    "step-104m-eager": ("large", [], "step 104M bf16 eager"),
    "step-26m-compiled": ("small", ["--compile", "--profile"], "step 26M bf16 compiled"),
    "step-104m-compiled": ("large", ["--compile"], "step 104M bf16 compiled"),
    "moe-26m-eager": ("small", ["--moe"], "step 26M MoE 4x top-1 bf16 eager"),
    "moe-26m-compiled": ("small", ["--moe", "--compile"], "step 26M MoE 4x top-1 bf16 compiled"),
    "docmask-26m-compiled": ("small", ["--document-mask", "--compile"], "step 26M --document-mask compiled"),
    "muon-26m-compiled": ("small", ["--optimizer", "muon", "--compile"], "step 26M Muon compiled"),
    "ac-104m-compiled": ("large", ["--activation-checkpointing", "--compile"],
                         "step 104M activation checkpointing compiled"),
}
ROW_PARTS = tuple(ROWS)

# ---- the plan ---------------------------------------------------------------------------------------------------

# The lent machine (/work/.library/device/README.md): device time per task including its cold start, one command's
# limit. One command runs the bundle's install, the check and the writing of its results; what the device time
# leaves after the machine's start and that command is a rerun's (`--only`) of what the plan left out.
DEVICE_S, COMMAND_S = 900, 600
MACHINE_START_S, INSTALL_S, RESULTS_S = 150, 30, 30  # "a minute or more" to start; pip of ~40 MB of wheels
# Seconds for the parts. The CPU dry run's is a cap only (it takes ~3 minutes): room for a CI box 2x slower than
# this one, whose slower cold start rescales every limit (`replan`), with every part still in the plan.
BUDGET = {"cuda": COMMAND_S - INSTALL_S - RESULTS_S, "cpu": 2400}
SPARE = 0.2  # of the budget no plan uses: the limits are estimates, and the machine may be slower still


@dataclass(frozen=True)
class Assume:
    """Seconds a part's limit is made of (each limit: margin x the sum of those it needs)."""

    cold_start: float  # the first process: the preflight on a cold disk (its measured wall rescales the plan)
    start: float  # a later process: python, torch from the page cache, the device's context, the matmul peak
    compile_cold: float  # Inductor's first compilation of a block graph (forward + backward)
    compile_warm: float  # the same graph again, from Inductor's on-disk cache
    train_start: float  # a Ray Train run's start: controller, worker, process group, Ray Data pipeline
    margin: float


ASSUME = {
    # GPU: issue #34's reading (30 s: torch cu130 from a cold disk, the CUDA context, Ray Train/Data, a first
    # compiled forward+backward, flash attention); estimates until a first run measures them (its JSON has each
    # part's wall time), with margin.
    "cuda": Assume(cold_start=30, start=8, compile_cold=30, compile_warm=8, train_start=20, margin=1.5),
    # CPU dry run: this rehearsal from a cold start (empty Inductor cache) on the 2-core machine, measured
    # 2026-12-01 (bench/RESULTS.md: preflight 3-6 s, eager parts 2-4 s, a cold compiled row 20-27 s, a warm one
    # 6-7 s, a Ray Train half 16-29 s); margin for CI's shared 2-core box.
    "cpu": Assume(cold_start=6, start=3, compile_cold=20, compile_warm=6, train_start=18, margin=3.0),
}


@dataclass(frozen=True)
class Spec:
    """One part of the check, in the plan's order (value: never run on a GPU first, refinements last)."""

    name: str
    work: tuple[float, float]  # seconds once started (GPU, CPU dry run): steps, saves, reads
    graph: str | None = None  # the compiled block graph it compiles; the first part of each compiles it cold
    ray: bool = False  # its driver joins the local Ray
    train: bool = False  # it starts a Ray Train run
    needs: tuple[str, ...] = ()  # parts whose results it takes
    what: str = ""


SPECS = (
    Spec("preflight", (0, 0), graph="tiny", what="versions, cold start; gates: Ray import, compile, flash"),
    Spec("step-26m-eager", (4, 2), what="the 26M step: the Trainer's and the Ray job's reference"),
    Spec("ddp1-26m", (5, 3), what="never run: DDP over NCCL, an all-reduce on the device"),
    Spec("trainer-ddp1-26m", (8, 4), graph="26m", what="never run: the Trainer DDP-wrapped in an NCCL group"),
    Spec("moe-26m-compiled", (3, 2), graph="26m-moe", what="never run: the grouped MoE dispatch, compiled"),
    Spec("checkpoint-stall-104m", (15, 6), what="never run: the async checkpoint's stall on the device"),
    Spec("prepare", (8, 8), ray=True, what="the demo corpus through Ray Data"),
    Spec("ray-job", (6, 3), ray=True, train=True, needs=("prepare",), what="never run: the 1-GPU Ray job, half"),
    Spec("ray-job-resume", (6, 3), ray=True, train=True, needs=("ray-job",), what="never run: ... resumed to the end"),
    Spec("export", (3, 2), needs=("ray-job-resume",), what="the last checkpoint exported"),
    Spec("sample", (3, 1), needs=("export",), what="text sampled from the export"),
    Spec("step-104m-compiled", (5, 2), graph="104m", what="headline: 104M compiled, MFU goal 45%"),
    Spec("step-26m-compiled", (4, 3), graph="26m", what="headline: 26M compiled, MFU goal 30%; a profiled step"),
    Spec("fp16", (10, 6), what="fp16 with the GradScaler: an overflow skipped"),
    Spec("docmask-26m-compiled", (3, 2), graph="26m-docmask", what="--document-mask, compiled"),
    Spec("muon-26m-compiled", (4, 2), graph="26m", what="Muon, compiled"),
    Spec("ac-104m-compiled", (6, 2), graph="104m-ac", what="activation checkpointing at 104M, compiled"),
    Spec("step-104m-eager", (5, 2), what="104M eager"),
    Spec("moe-26m-eager", (3, 2), what="MoE eager (split dispatch on CPU)"),
    Spec("trainer", (10, 3), what="minilm.train in-process, validation on the device"),
    Spec("checkpoint-104m", (15, 5), what="checkpoint save + restore at 104M"),
    Spec("stream", (8, 6), ray=True, needs=("prepare",), what="Ray Data stream delivery to the device"),
)
SPEC = {s.name: s for s in SPECS}
RAY_PARTS = tuple(s.name for s in SPECS if s.ray)


def part_limit(spec: Spec, a: Assume, device: str, cold_graphs: set[str], scale: float = 1.0) -> float:
    """The part's limit: margin x (its process start + work + compilation + Ray Train start), x `scale` (how much
    slower than assumed the measured cold start was), rounded up to 5 s. `cold_graphs`: graphs not compiled yet."""
    work = spec.work[0 if device == "cuda" else 1]
    start = a.cold_start if spec.name == "preflight" else a.start
    compiling = 0.0 if spec.graph is None or spec.name == "preflight" else (
        a.compile_cold if spec.graph in cold_graphs else a.compile_warm)
    seconds = a.margin * (start + work + compiling + (a.train_start if spec.train else 0.0)) * scale
    return float(-(-seconds // 5) * 5)


@dataclass
class Plan:
    device: str
    budget: float
    parts: list[tuple[str, float]]  # (part, limit) in the order they run
    left: list[tuple[str, float]]  # parts that did not fit, with their limits
    added: list[str]  # parts --only did not name but a named one needs
    scale: float = 1.0

    @property
    def total(self) -> float:
        return sum(limit for _, limit in self.parts)

    def limit(self, name: str) -> float:
        return dict(self.parts)[name]

    def lines(self) -> list[str]:
        a = ASSUME[self.device]
        head = [f"# plan ({'the lent GPU' if self.device == 'cuda' else 'the CPU dry run'}): parts in order of value, "
                f"each limit = {a.margin:g} x (start + work + compile + Ray Train start), within {1 - SPARE:.0%} of "
                f"the {self.budget:.0f} s budget",
                f"#   assumed: cold start {a.cold_start:g} s, a start {a.start:g} s, a new block graph's compile "
                f"{a.compile_cold:g} s, from the cache {a.compile_warm:g} s, a Ray Train start {a.train_start:g} s"
                + (f"; rescaled x{self.scale:.2f} from the measured cold start" if self.scale != 1.0 else "")]
        if self.device == "cuda":
            head.append(f"#   device time {DEVICE_S} s = machine start {MACHINE_START_S} + one command {COMMAND_S} "
                        f"(bundle install {INSTALL_S}, the check {self.budget:.0f}, results {RESULTS_S}) + "
                        f"{DEVICE_S - MACHINE_START_S - COMMAND_S} s for a rerun of what is left")
        body = [f"  {i:2d}. {name:<22} {limit:5.0f} s  {SPEC[name].what}" for i, (name, limit) in
                enumerate(self.parts, 1)]
        tail = [f"  added for --only: {', '.join(self.added)} (needed by the parts named)"] if self.added else []
        if self.left:
            tail.append(f"  left for a rerun (over the budget): {', '.join(f'{n} {lim:.0f} s' for n, lim in self.left)}"
                        f"; python -m bench.gpu_check --only {','.join(n for n, _ in self.left)}")
        return [*head, *body, *tail, f"total {self.total:.0f} s of {self.budget:.0f} s"]


def with_needs(names: set[str]) -> set[str]:
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(SPEC[name].needs)
    return out


def make_plan(device: str, budget: float, only: set[str] | None = None, done: tuple[str, ...] = (),
              scale: float = 1.0, compiled: set[str] = frozenset()) -> Plan:
    """The parts (all, or `only` and what they need), in SPECS order, while their limits fit (1 - SPARE) x budget;
    a part that does not fit is left for a rerun, and so is every part that needs it. `done` parts (already run:
    a re-plan after the preflight) keep their place and count nothing; `compiled`: graphs already compiled."""
    a = ASSUME[device]
    wanted = with_needs(only) if only else set(SPEC)
    cold_graphs = {s.graph for s in SPECS if s.graph} - set(compiled)
    parts, left, total = [], [], 0.0
    for spec in SPECS:
        if spec.name not in wanted or spec.name in done:
            continue
        limit = part_limit(spec, a, device, cold_graphs, scale)
        if total + limit > (1 - SPARE) * budget or any(n in dict(left) for n in spec.needs):
            left.append((spec.name, limit))
            continue
        parts.append((spec.name, limit))
        total += limit
        cold_graphs.discard(spec.graph)
    added = sorted(wanted - set(only)) if only else []
    return Plan(device, budget, parts, left, added, scale)


@dataclass
class Shapes:
    """The configs of one check: the real ones on a GPU, tiny ones for the CPU dry run."""

    small: dict  # MiniMind-26M: the rows, fp16, the Trainer, the Ray job
    large: dict  # MiniMind-104M: the rows only
    job_steps: int  # the Ray job's optimizer steps (it exits halfway and resumes)
    trainer_steps: int
    row_args: list[str]  # the rows' timing flags
    fp16_args: list[str]
    corpus_bytes: int | None  # the demo corpus, cut to this size (None: whole)
    stream_steps: int
    ddp_args: list[str] = field(default_factory=list)
    trainer_ddp_args: list[str] = field(default_factory=list)
    row_extra: dict = field(default_factory=dict)  # more flags for one row on this device
    cpus_per_worker: int = 4  # the Ray job's worker: 4 of the lent machine's 16 cores, the rest for Ray Data
    object_store_bytes: int = 2 << 30  # the local Ray's, fixed (RAY_* above)


GPU = Shapes(
    small={"hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 32},
    large={"hidden_size": 768, "num_hidden_layers": 16, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 128},
    job_steps=200, trainer_steps=200, row_args=["--steps", "20", "--warmup", "5"], fp16_args=[],
    corpus_bytes=None, stream_steps=400, ddp_args=["--steps", "10"], trainer_ddp_args=["--compile", "--steps", "40"])
CPU = Shapes(
    small={"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    large={"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    job_steps=8, trainer_steps=12, row_args=["--steps", "2", "--warmup", "1", "--peak-size", "256"],
    fp16_args=["--micro-batch-size", "2", "--seq-len", "32", "--hidden-size", "64", "--num-hidden-layers", "2",
               "--vocab-size", "1024"],
    corpus_bytes=200_000, stream_steps=20, ddp_args=["--steps", "4"], trainer_ddp_args=["--steps", "6"],
    # CPU has no sync-free grouped_mm, so "auto" splits there: the rehearsal compiles the grouped dispatch itself
    row_extra={"moe-26m-compiled": ["--moe-dispatch", "grouped"]}, cpus_per_worker=1, object_store_bytes=256 << 20)


# ---- running a part ---------------------------------------------------------------------------------------

class Stopped(BaseException):
    """A signal (SIGTERM from `timeout`, SIGINT, SIGHUP) asked the check to stop."""


def on_signal(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


@dataclass
class Part:
    name: str
    status: str = "skipped"  # ok | failed | timeout | stopped | skipped
    wall_s: float = 0.0
    note: str = ""
    output: str = ""


class Runner:
    """Runs each part as a subprocess in its own process group with its limit (`limits`, the plan's), never past
    the overall budget; its output goes to work/logs/<part>.log, and `after_part` runs after every part (the
    results are rewritten)."""

    def __init__(self, python: str, budget_s: float, work: Path, env: dict, after_part=None):
        self.python, self.deadline, self.work, self.env = python, time.monotonic() + budget_s, work, env
        self.logs, self.results = work / "logs", work / "results"
        self.parts: dict[str, Part] = {}
        self.limits: dict[str, float] = {}
        self.groups: list[int] = []  # every part's process group, killed again at exit
        self.after_part = after_part or (lambda: None)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)

    def skip(self, name: str, why: str) -> Part:
        part = self.parts[name] = Part(name, "skipped", note=why)
        print(f"[{name}] skipped: {why}", flush=True)
        return part

    def run(self, name: str, args: list[str], env: dict | None = None) -> Part:
        left = self.deadline - time.monotonic()
        if left < 5:
            return self.skip(name, "out of time (--budget)")
        timeout = min(self.limits[name], left)
        print(f"[{name}] {' '.join(args)}  (limit {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        proc = subprocess.Popen([self.python, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**self.env, **(env or {})}, start_new_session=True)
        self.groups.append(proc.pid)
        try:
            out, _ = proc.communicate(timeout=timeout)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            out = stop_group(proc)
            status = "timeout"
        except BaseException:  # Stopped: the part in flight goes first, then the check writes its results
            out = stop_group(proc, grace_s=5)
            self.record(Part(name, "stopped", time.monotonic() - t0, note="stopped by a signal", output=out))
            raise
        finally:
            kill_group(proc.pid)  # what the part left behind in its group (a local Ray's processes, say)
        part = Part(name, status, time.monotonic() - t0, output=out or "")
        if status == "failed":
            part.note = f"exit {proc.returncode}: {last_line(part.output)}"
        elif status == "timeout":
            part.note = f"stopped at its {timeout:.0f} s limit"
        self.record(part)
        print(f"[{name}] {status} in {part.wall_s:.0f} s{': ' + part.note if part.note else ''}", flush=True)
        self.after_part()
        return part

    def record(self, part: Part) -> None:
        (self.logs / f"{part.name}.log").write_text(part.output)
        self.parts[part.name] = part

    def kill_all(self) -> None:
        for pgid in self.groups:
            kill_group(pgid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> str:
    """SIGTERM to the part's process group (a Ray driver then shuts down what it started), SIGKILL after
    `grace_s`; returns what it printed."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=wait)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1][:200]


def flags(shape: dict, *keys: str) -> list[str]:
    return [x for k in keys for x in ("--" + k.replace("_", "-"), str(shape[k]))]


def missing_modules(names) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


# ---- the parts ------------------------------------------------------------------------------------------------

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "seq_len", "micro_batch_size")


@dataclass
class Check:
    """What the parts share: the runner, the configs, the device, the work folder, the figures, the gates."""

    r: Runner
    s: Shapes
    device: str
    work: Path
    fig: dict
    gates: dict = field(default_factory=dict)  # "ray" | "compile" -> why it is closed
    data: Path | None = None  # what `prepare` wrote

    def json_part(self, name: str, args: list[str], path: Path, env: dict | None = None) -> dict | None:
        """Run a part whose subcommand writes `path`; its JSON, or None if it did not finish."""
        part = self.r.run(name, args, env)
        if part.status != "ok" or not path.is_file():
            return None
        self.r.after_part()
        return json.loads(path.read_text())


def row_part(c: Check, name: str) -> None:
    """One row (`python -m bench.gpu_check row`) in its own process; printed and kept the moment it ends."""
    which, extra, _ = ROWS[name]
    shape = c.s.large if which == "large" else c.s.small
    path = c.r.results / f"{name}.json"
    args = ["-m", "bench.gpu_check", "row", "--name", name, "--json", str(path), "--device", c.device,
            "--dtype", "bf16", *c.s.row_args, *flags(shape, *SHAPE_KEYS), *extra, *c.s.row_extra.get(name, [])]
    row = c.json_part(name, args, path)
    if row is not None:
        c.fig.setdefault("rows", {})[name] = row
        c.r.parts[name].note = describe_row(row)
        print(f"[{name}] row: {c.r.parts[name].note}", flush=True)
        c.r.after_part()


def describe_row(row: dict) -> str:
    sheet = row["mfu_datasheet"] is not None
    mfu = row["mfu_datasheet"] if sheet else row["mfu"]
    text = (f"{row['tokens_per_s']:,.0f} tok/s, MFU {mfu:.1%}"
            + (f" (of the measured matmul peak: {row['mfu']:.1%})" if sheet else " (of the measured peak)"))
    if row.get("peak_memory_bytes") is not None:
        text += f", peak memory {row['peak_memory_bytes'] / 2**30:.2f} GiB ({row['peak_memory_of']})"
    if row["compile"]:
        text += (f", compile {row['compile_s']:.1f} s, {row['graph_breaks']} graph break(s), "
                 f"{row['recompiles']} recompile(s)")
    if row.get("moe_dispatch"):
        text += f", MoE dispatch {row['moe_dispatch']}"
    if row.get("profile"):
        text += f"; profiled step: flash attention {'used' if row['profile']['flash'] else 'NOT used'}"
    return text


def preflight_part(c: Check) -> None:
    """The preflight's versions, cold start and gates: a closed gate skips the parts behind it, nothing else."""
    path = c.r.results / "preflight.json"
    found = c.json_part("preflight", ["-m", "bench.gpu_check", "preflight", "--device", c.device, "--json",
                                      str(path)], path)
    c.fig["preflight"] = found
    if found is None:
        return  # no gates known: every part runs and fails on its own if it must
    c.gates.update({k: v for k, v in found["gates"].items() if v and k in ("ray", "compile")})
    c.r.parts["preflight"].note = found["line"] + "".join(f"; {k} gate closed: {v}" for k, v in found["gates"].items()
                                                          if v)
    c.r.after_part()


def ddp1_part(c: Check) -> None:
    path = c.r.results / "ddp1-26m.json"
    c.fig["ddp1"] = c.json_part("ddp1-26m", ["-m", "bench.gpu_check", "ddp1", "--device", c.device, "--json", str(path),
                                             *flags(c.s.small, *SHAPE_KEYS), *c.s.ddp_args], path)


def trainer_ddp1_part(c: Check) -> None:
    path = c.r.results / "trainer-ddp1-26m.json"
    extra = [a for a in c.s.trainer_ddp_args if not (a == "--compile" and "compile" in c.gates)]  # eager, then
    c.fig["trainer_ddp1"] = c.json_part("trainer-ddp1-26m", ["-m", "bench.gpu_check", "trainer-ddp1", "--device",
                                                             c.device, "--json", str(path),
                                                             *flags(c.s.small, *SHAPE_KEYS), *extra], path)


def fp16_part(c: Check) -> None:
    part = c.r.run("fp16", ["-m", "bench.fp16_check", "--device", c.device, *c.s.fp16_args],
                   env={"MINILM_BENCH_RESULTS": str(c.r.results / "fp16")})
    path = c.r.results / "fp16" / "fp16_check.json"
    if part.status in ("ok", "failed") and path.is_file():
        c.fig["fp16"] = json.loads(path.read_text())


def trainer_part(c: Check) -> None:
    """`python -m minilm.train` at the small shape on random ids: the Trainer's wall time per step."""
    from .overhead import read_metrics, steady_step_s

    shape, steps = c.s.small, c.s.trainer_steps
    run_dir = c.work / "trainer"
    sequences = 4 * shape["micro_batch_size"]
    args = ["-m", "minilm.train", "--random-tokens", str(sequences * (shape["seq_len"] + 1)), "--run-dir", str(run_dir),
            *flags(shape, *SHAPE_KEYS),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", "bf16",
            "--max-steps", str(steps), "--warmup-steps", "1", "--log-every", str(max(1, steps // 20)),
            "--checkpoint-every", str(steps), "--val-samples", str(shape["micro_batch_size"])]
    part = c.r.run("trainer", args)
    if part.status != "ok":
        return
    records = read_metrics(run_dir / "metrics.jsonl")
    step_s, counted = steady_step_s(records, steps)
    shutil.rmtree(run_dir, ignore_errors=True)
    val = [rec["val_loss"] for rec in records if "val_loss" in rec]
    if not val:
        part.status, part.note = "failed", "no val_loss (--val-samples) in its metrics"
    c.fig["trainer"] = {"step_s": step_s, "steps_counted": counted, "val_loss": val[-1] if val else None,
                        "tokens_per_s": shape["micro_batch_size"] * shape["seq_len"] / step_s}


def checkpoint_part(c: Check) -> None:
    """`bench.checkpoint` at the 104M size (save = resume state + export, restore with its hash check) on this
    machine's disk; the table puts the save against the 104M row's step at the default cadence."""
    shape, out = c.s.large, c.r.results / "checkpoint-104m"
    found = c.json_part("checkpoint-104m", ["-m", "bench.checkpoint", "--sizes",
                                            f"{shape['hidden_size']}x{shape['num_hidden_layers']}", "--vocab-size",
                                            str(shape["vocab_size"]), "--repeats", "1", "--dir", str(c.work)],
                        out / "checkpoint.json", env={"MINILM_BENCH_RESULTS": str(out)})
    if found:
        row = found["rows"][0]
        c.fig["checkpoint"] = {k: row[k] for k in ("params", "save_s", "restore_s", "resume_bytes", "export_bytes")}


def checkpoint_stall_part(c: Check) -> None:
    """`bench.checkpoint --mode stall` at the 104M size on this device: what the training thread loses per
    checkpoint, sync against async (on CUDA the snapshot goes to pinned buffers reused between saves)."""
    shape, out = c.s.large, c.r.results / "checkpoint-stall-104m"
    found = c.json_part("checkpoint-stall-104m", ["-m", "bench.checkpoint", "--mode", "stall", "--device", c.device,
                                                  "--sizes", f"{shape['hidden_size']}x{shape['num_hidden_layers']}",
                                                  "--vocab-size", str(shape["vocab_size"]), "--seq-len",
                                                  str(shape["seq_len"]), "--repeats", "1", "--dir", str(c.work)],
                        out / "checkpoint_stall.json", env={"MINILM_BENCH_RESULTS": str(out)})
    if found:
        row = found["rows"][0]
        c.fig["checkpoint_stall"] = {k: row[k] for k in ("sync_stall_s", "async_stall_s", "async_write_s")}


def prepare_part(c: Check) -> None:
    from minilm.corpus import write_demo_corpus

    corpus = c.work / "demo-corpus.jsonl"
    if c.s.corpus_bytes:
        write_demo_corpus(corpus, max_bytes=c.s.corpus_bytes)
    else:
        write_demo_corpus(corpus)
    data = c.work / "data"
    part = c.r.run("prepare", ["-m", "ray_jobs.prepare", "--input", str(corpus), "--output", str(data), "--seq-len",
                               str(c.s.small["seq_len"]), "--vocab-size", str(c.s.small["vocab_size"]), "--overwrite"])
    if part.status == "ok":
        found = re.search(r"[\d,]+ sequences of \d+\+1 tokens", part.output)
        part.note = found.group(0) if found else "prepared"
        c.data = data


def job_args(c: Check) -> list[str]:
    shape = c.s.small
    return ["-m", "ray_jobs.pretrain", "--data", str(c.data), "--use-gpu", "true" if c.device == "cuda" else "false",
            "--num-workers", "1", "--cpus-per-worker", str(c.s.cpus_per_worker), "--storage-path",
            str(c.work / "runs"), "--name", "gpu-check", *flags(shape, *SHAPE_KEYS),
            "--global-batch-size", str(shape["micro_batch_size"]), "--dtype", "bf16", "--max-steps",
            str(c.s.job_steps), "--warmup-steps", "1", "--log-every", str(max(1, c.s.job_steps // 30)),
            "--checkpoint-every", str(c.s.job_steps)]


def ray_job_part(c: Check) -> None:
    """Train to half the steps (--exit-after-steps); `ray_job_resume_part` continues to the end."""
    c.r.run("ray-job", [*job_args(c), "--exit-after-steps", str(c.s.job_steps // 2)])


def ray_job_resume_part(c: Check) -> None:
    """The same command again: it must continue from the first half's checkpoint. Tokens/s of each half."""
    from .overhead import read_metrics, steady_step_s

    second = c.r.run("ray-job-resume", job_args(c))
    if second.status != "ok":
        return
    half, steps, run = c.s.job_steps // 2, c.s.job_steps, c.work / "runs" / "gpu-check"
    records = read_metrics(run / "metrics.jsonl")
    resumed = f"resumed run gpu-check at optimizer step {half}" in second.output
    second.note = f"continued from step {half}" if resumed else "did not report resuming"
    if not resumed:
        second.status = "failed"
    tokens = c.s.small["micro_batch_size"] * c.s.small["seq_len"]
    halves = {}
    for key, part in (("first", [rec for rec in records if rec["optimizer_step"] <= half]),
                      ("resumed", [rec for rec in records if rec["optimizer_step"] > half])):
        step_s, counted = steady_step_s(part, steps)
        halves[key] = {"step_s": step_s, "steps_counted": counted, "tokens_per_s": tokens / step_s}
    checkpoints = sorted(p for p in run.glob("checkpoint_*") if p.is_dir())
    c.fig["ray_job"] = {"halves": halves, "tokens_per_s": halves["resumed"]["tokens_per_s"],
                        "last_step": records[-1]["optimizer_step"], "resumed": resumed,
                        "checkpoint": str(checkpoints[-1]) if checkpoints else None,
                        "data_wait_frac": [rec["data_wait_frac"] for rec in records]}


def export_part(c: Check) -> None:
    if not (c.fig.get("ray_job") or {}).get("checkpoint"):
        c.r.skip("export", "no checkpoint from the Ray job")
        return
    c.r.run("export", ["-m", "ray_jobs.export", "--checkpoint", c.fig["ray_job"]["checkpoint"], "--output",
                       str(c.work / "export")])


def sample_part(c: Check) -> None:
    part = c.r.run("sample", ["-m", "minilm.sample", "--weights", str(c.work / "export"), "--prompt", "Return the",
                              "--max-new-tokens", "24"])
    text = " ".join(part.output.split()) if part.status == "ok" else ""
    if part.status == "ok" and not text:
        part.status, part.note = "failed", "sampled nothing"
    c.fig["sample"] = text or None


def stream_part(c: Check) -> None:
    """One rank's `RankStream` (the job's own pipeline) driven alone on the prepared data: `stream_rate`.
    (`bench.data --mode stream` measures the same on a synthetic dataset of its own, too big for this budget.)"""
    shape = c.s.small
    part = c.r.run("stream", ["-m", "bench.gpu_check", "stream-rate", "--data", str(c.data), "--seq-len",
                              str(shape["seq_len"]), "--vocab-size", str(shape["vocab_size"]), "--micro-batch-size",
                              str(shape["micro_batch_size"]), "--steps", str(c.s.stream_steps), "--global-batch-size",
                              str(shape["micro_batch_size"]), "--device", c.device])
    found = re.search(r"stream delivery rate: ([\d,]+) tokens/s", part.output) if part.status == "ok" else None
    if found:
        c.fig["stream"] = {"tokens_per_s": float(found.group(1).replace(",", "")), "by": "ray_jobs.stream.RankStream",
                           "to": c.device}


PART_RUNS = {"preflight": preflight_part, "ddp1-26m": ddp1_part, "trainer-ddp1-26m": trainer_ddp1_part,
             "fp16": fp16_part, "trainer": trainer_part, "checkpoint-104m": checkpoint_part,
             "checkpoint-stall-104m": checkpoint_stall_part, "prepare": prepare_part, "ray-job": ray_job_part,
             "ray-job-resume": ray_job_resume_part, "export": export_part, "sample": sample_part,
             "stream": stream_part, **{name: functools.partial(row_part, name=name) for name in ROW_PARTS}}
# ray-job-resume, export and sample need the last one's outcome, not only its figures
NEEDS_OK = {"ray-job-resume": "ray-job", "export": "ray-job-resume", "sample": "export", "stream": "prepare",
            "ray-job": "prepare"}


class LocalRay:
    """One local Ray for every Ray part (each part's driver joins it through RAY_ADDRESS), stopped after the last;
    none when RAY_ADDRESS names a cluster already. On 127.0.0.1: the lent machine has no network, and Ray finds a
    node's address by routing towards one. A fixed object store and no memory monitor: Ray would size both from
    the MemTotal of a VM whose memory starts small and grows as it is used. As many CPUs as cores."""

    def __init__(self, object_store_bytes: int):
        self.started, self.object_store_bytes, self.info = False, object_store_bytes, {}

    def address(self, gpu: bool) -> str:
        if os.environ.get("RAY_ADDRESS"):
            return os.environ["RAY_ADDRESS"]
        # Read by the raylet this init starts and by the drivers and workers after it: no memory monitor, and
        # 127.0.0.1 for this node (Ray's own choice when it is not meant to form a cluster; otherwise it probes a
        # route to 8.8.8.8 and, unreachable, falls back to resolving the host name: ray._private.services).
        os.environ.update(RAY_memory_monitor_refresh_ms="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        import ray

        cores = os.cpu_count() or 2
        # The lent machine's 16 cores as they are; the CPU dry run's 2 as ray_jobs.cli.ensure_ray counts them (more
        # logical CPUs than cores: a worker must leave Ray Data some).
        ray.init(address="local", num_cpus=cores if gpu else max(8, 2 * cores), num_gpus=1 if gpu else 0,
                 object_store_memory=self.object_store_bytes, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        self.started = True
        node = ray.nodes()[0]
        self.info = {"node_ip": node["NodeManagerAddress"], "num_cpus": node["Resources"].get("CPU"),
                     "object_store_bytes": int(node["Resources"].get("object_store_memory", 0)),
                     "memory_monitor_refresh_ms": os.environ["RAY_memory_monitor_refresh_ms"]}
        return ray.get_runtime_context().gcs_address

    def stop(self) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False


# ---- the subcommands a part runs ---------------------------------------------------------------------------

def stream_rate(argv: list[str]) -> int:
    """Drive one rank's `RankStream` (world size 1, micro-batches to host memory) with nothing else in the loop."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check stream-rate")
    p.add_argument("--data", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps timed after the first (pipeline start)")
    p.add_argument("--device", default="cpu", help="where the micro-batches go (cuda: pinned, async copies)")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from minilm import data as D
    from ray_jobs.cli import ensure_ray

    ensure_ray()
    from ray_jobs.stream import RankStream

    prepared = D.open_prepared(args.data)
    D.check_compatible(prepared, vocab_size=args.vocab_size, seq_len=args.seq_len)
    train_ids = np.arange(prepared.num_sequences, dtype=np.int64)
    per_epoch = D.steps_per_epoch(len(train_ids), args.global_batch_size)
    stream = RankStream(args.data, D.RankOrder(train_ids, 0, per_epoch, args.global_batch_size, 1, 0, 0),
                        args.steps + 1, args.micro_batch_size, torch.device(args.device))
    t0 = time.perf_counter()
    stream.next_step()
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(args.steps):
        micro_batches, _ = stream.next_step()
        tokens += sum(b.shape[0] * (b.shape[1] - 1) for b in micro_batches)
    if stream.device.type == "cuda":
        torch.cuda.synchronize(stream.device)  # the last copies have landed
    elapsed = time.perf_counter() - t0
    print(f"pipeline start {start_s:.2f} s; {args.steps} steps of {args.global_batch_size} x {args.seq_len} tokens in "
          f"{elapsed:.2f} s ({per_epoch} steps per epoch)")
    print(f"stream delivery rate: {tokens / elapsed:,.0f} tokens/s")
    return 0


class DynamoCounts:
    """Graph breaks, compiled graphs and recompiles of this process's torch.compile (dynamo's counters and its
    `recompiles` log)."""

    def __init__(self):
        import logging

        import torch._dynamo.guards  # noqa: F401  (creates the recompiles logger)
        import torch._logging

        self.recompiles = 0
        torch._logging.set_logs(recompiles=True)
        counts = self

        class Count(logging.Handler):
            def emit(self, record):
                counts.recompiles += record.getMessage().startswith("Recompiling")

        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(Count())

    def read(self) -> dict:
        from torch._dynamo.utils import counters

        return {"graph_breaks": sum(counters["graph_break"].values()),
                "graphs": counters["stats"].get("unique_graphs", 0), "recompiles": self.recompiles}


def row(argv: list[str]) -> int:
    """One row of the table: optimizer steps of one config, timed alone in this process; writes --json."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check row")
    add_model_args(p)
    p.add_argument("--name", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--moe", action="store_true", help="4 experts, top-1 (the dense model's active width)")
    p.add_argument("--moe-dispatch", choices=["auto", "grouped", "split"], default="auto",
                   help="minilm.model.MoEFeedForward.dispatch")
    p.add_argument("--document-mask", action="store_true", help="attention within each document (ModelConfig)")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler: its top kernels")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (with --compile: the compilation)")
    p.add_argument("--peak-size", type=int, default=None, help="n of the n^3 matmul peak (default 8192 GPU, 2048 CPU)")
    args = p.parse_args(argv)
    import statistics

    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM, MoEFeedForward
    from minilm.progress import datasheet_peak, measured_matmul_peak
    from minilm.step import (
        TORCH_DTYPES,
        configure_backends,
        make_grad_scaler,
        make_optimizer,
        optimizer_step,
        prepare_model,
    )

    device = torch.device(args.device)
    dtype = TORCH_DTYPES[args.dtype]
    configure_backends(device)
    counts = DynamoCounts() if args.compile else None
    peak = measured_matmul_peak(dtype, n=args.peak_size or (8192 if device.type == "cuda" else 2048), repeats=10,
                                device=device)
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                      vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1, use_moe=args.moe,
                      num_experts=4, num_experts_per_tok=1, document_mask=args.document_mask)
    MoEFeedForward.dispatch = args.moe_dispatch
    model = MiniMindForCausalLM(cfg).to(device).train()
    moe_dispatch = None
    if args.moe:  # what "auto" resolves to here: grouped where grouped_mm has its sync-free kernel
        grouped = model.moe_layers()[0].grouped_kernel and dtype == torch.bfloat16
        moe_dispatch = args.moe_dispatch if args.moe_dispatch != "auto" else ("grouped" if grouped else "split")
    train_cfg = TrainConfig(lr=1e-4, compile=args.compile, activation_checkpointing=args.activation_checkpointing,
                            optimizer=args.optimizer)
    model = prepare_model(model, train_cfg, device)
    optimizer = make_optimizer(model, train_cfg)
    scaler = make_grad_scaler(dtype, device.type)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        m = optimizer_step(model, optimizer, scaler, [batch], lr=1e-4, grad_clip=1.0, dtype=dtype)
        float(m.loss)  # the step is done when its loss is on the host
        times.append(time.perf_counter() - t0)
    profile = profiled_step(model, optimizer, scaler, batches[-1], dtype, device) if args.profile else None
    warm, timed = times[:args.warmup], times[args.warmup:]
    step_s = statistics.median(timed)
    tokens = args.micro_batch_size * args.seq_len
    sheet = datasheet_peak(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if device.type == "cuda":
        peak_memory, peak_of = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    else:
        import resource

        peak_memory, peak_of = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "the process's max RSS"
    result = {"name": args.name, "config": ("moe" if args.moe else "dense") + ("+compile" if args.compile else ""),
              "dtype": args.dtype, "compile": args.compile, "params": model.num_params(),
              "active_params": model.num_params(active=True), "flops_per_token": model.flops_per_token(args.seq_len),
              "tokens_per_step": tokens, "step_s_median": step_s, "step_s_min": min(timed), "step_s_all": timed,
              "warmup_s": sum(warm), "tokens_per_s": tokens / step_s, "peak_flops": peak,
              "peak_flops_datasheet": sheet, "mfu": model.estimate_mfu(tokens / step_s, args.seq_len, peak),
              "mfu_datasheet": model.estimate_mfu(tokens / step_s, args.seq_len, sheet) if sheet else None,
              "peak_memory_bytes": peak_memory, "peak_memory_of": peak_of,
              # the warm-up steps' time beyond as many steady steps: compilation and autotuning
              "compile_s": max(0.0, sum(warm) - len(warm) * step_s) if args.compile else None,
              "document_mask": args.document_mask, "optimizer": args.optimizer,
              "activation_checkpointing": args.activation_checkpointing, "profile": profile,
              "moe_dispatch": moe_dispatch,
              **(counts.read() if counts else {"graph_breaks": None, "graphs": None, "recompiles": None})}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"row {args.name}: {describe_row(result)}")
    return 0


def training_device(name: str):
    """The device a part trains on, made this thread's current one. CUDA: with an index, the current device's when
    `name` has none (torch.cuda.set_device refuses a device without one; NCCL and the allocator use the current)."""
    import torch

    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def ddp1(argv: list[str]) -> int:
    """DDP in a 1-rank process group (NCCL on CUDA, gloo on CPU) against the same model without DDP, step by step:
    the group's start, DDP's gradient reducer (over compiled blocks with --compile) with no_sync accumulation, and
    an all-reduce on the training device run for real, and the losses must agree."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check ddp1")
    add_model_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    from minilm.config import ModelConfig, TrainConfig
    from minilm.distributed import leave_process_group
    from minilm.model import MiniMindForCausalLM
    from minilm.step import (
        configure_backends,
        make_grad_scaler,
        make_optimizer,
        optimizer_step,
        prepare_model,
    )
    from minilm.trainer import wrap_ddp

    device = training_device(args.device)
    configure_backends(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                              num_attention_heads=args.num_attention_heads,
                              num_key_value_heads=args.num_key_value_heads, vocab_size=args.vocab_size,
                              max_position_embeddings=args.seq_len + 1)
            train_cfg = TrainConfig(optimizer="adamw", lr=1e-4, compile=args.compile)
            runs = {}
            for name in ("plain", "ddp"):
                torch.manual_seed(0)
                model = prepare_model(MiniMindForCausalLM(cfg).to(device).train(), train_cfg, device)
                wrapped = wrap_ddp(model, device) if name == "ddp" else model
                runs[name] = (wrapped, make_optimizer(model, train_cfg), make_grad_scaler(torch.bfloat16, device.type))
            gen = torch.Generator().manual_seed(1)
            losses: dict[str, list[float]] = {"plain": [], "ddp": []}
            t0 = time.perf_counter()
            for _ in range(args.steps):
                micro = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_len + 1), generator=gen)
                         .to(device) for _ in range(2)]  # accumulation 2: no_sync, then the reducer's all-reduce
                for name, (model, optimizer, scaler) in runs.items():
                    m = optimizer_step(model, optimizer, scaler, micro, lr=1e-4, grad_clip=1.0, dtype=torch.bfloat16)
                    loss = m.loss.detach().reshape(1).clone()
                    if name == "ddp":
                        dist.all_reduce(loss)  # the loop's metric all-reduce, on the training device
                    losses[name].append(float(loss))
            wall_s = time.perf_counter() - t0
        finally:
            runs, wrapped, model = {}, None, None  # DDP goes while its group lives (gloo's destructor can hang after)
            leave_process_group()
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses["ddp"], losses["plain"], strict=True))
    result = {"backend": backend, "compile": args.compile, "steps": args.steps, "losses": losses,
              "max_relative_difference": worst, "wall_s": wall_s}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"ddp1: {backend}, {args.steps} steps of accumulation 2{' compiled' if args.compile else ''}: loss "
          f"{losses['ddp'][0]:.4f} -> {losses['ddp'][-1]:.4f}, largest relative difference from the plain model "
          f"{worst:.2e}")
    if worst > 1e-3:
        print(f"error: ddp1: DDP's losses differ from the plain model's by up to {worst:.2e} (relative)")
        return 1
    return 0


def trainer_ddp1(argv: list[str]) -> int:
    """minilm's Trainer (its loop, metrics, flag agreement and final save) for --steps, first as a plain world-size-1
    run, then in a 1-rank process group (NCCL on CUDA, gloo on CPU) with the model DDP-wrapped over its compiled
    blocks (--compile) and the loop's collectives (the metric means, the per-step flag agreement) sent through the
    group; writes both runs' tokens/s (the median of their log intervals after the first) and losses to --json."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check trainer-ddp1")
    add_model_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    import statistics

    import numpy as np
    import torch
    import torch.distributed as dist

    from minilm.config import ModelConfig
    from minilm.distributed import Collectives, leave_process_group
    from minilm.train import LocalLauncher
    from minilm.trainer import Dataset, RunOptions, Trainer, wrap_ddp

    class GroupCollectives(Collectives):
        """The loop's collectives through the process group even at world size 1 (Collectives skips them there)."""

        calls = 0

        def all_reduce(self, tensor, op=None, async_op=False):
            GroupCollectives.calls += 1
            tensor = self.to_device(tensor)
            return tensor, dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=async_op)

        def broadcast_from_rank0(self, tensor):
            GroupCollectives.calls += 1
            tensor = self.to_device(tensor.clone())
            dist.broadcast(tensor, src=0)
            return tensor

    class GroupTrainer(Trainer):
        """The Trainer as a rank of a multi-rank run sets itself up (DDP, collectives in the group), at world size 1."""

        def start(self) -> None:
            self.collectives = GroupCollectives(self.device)
            super().start()
            self.model = wrap_ddp(self.raw_model, self.device)

    device = training_device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                      vocab_size=args.vocab_size, max_position_embeddings=args.seq_len + 1)
    log_every = max(1, args.steps // 5)
    # accumulation 2 (DDP's no_sync, then the reducer's all-reduce); the final save keeps no files (no run folder)
    train_cfg = TrainConfig(optimizer="adamw", lr=1e-4, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                            global_batch_size=2 * args.micro_batch_size, max_steps=args.steps, warmup_steps=1,
                            log_every=log_every, checkpoint_every=args.steps, compile=args.compile, dtype="bf16")
    rows = np.random.default_rng(1).integers(0, args.vocab_size, (4 * args.micro_batch_size, args.seq_len + 1))
    data = Dataset.in_memory(rows)
    runs = {}
    for name, trainer_class in (("plain", Trainer), ("ddp", GroupTrainer)):
        with tempfile.TemporaryDirectory() as tmp:
            if name == "ddp":
                dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
            try:
                launcher = LocalLauncher(data, args.micro_batch_size, device=device,
                                         say=lambda line, name=name: print(f"{name}: {line}", flush=True))
                trainer = trainer_class(cfg, train_cfg, RunOptions(name=f"trainer-ddp1-{name}"), data, launcher)
                t0 = time.perf_counter()
                outcome = trainer.fit()
                wall_s = time.perf_counter() - t0
                ddp = isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
            finally:
                if name == "ddp":
                    trainer.model = trainer.raw_model  # DDP goes while its group lives
                    leave_process_group()
        rates = [m["tokens_per_s"] for m in trainer.history]
        runs[name] = {"outcome": outcome, "ddp": ddp, "wall_s": wall_s, "losses": [m["loss"] for m in trainer.history],
                      "tokens_per_s_intervals": rates,
                      "tokens_per_s": statistics.median(rates[1:] if len(rates) > 1 else rates)}
    worst = max(abs(a - b) / max(abs(b), 1e-6)
                for a, b in zip(runs["ddp"]["losses"], runs["plain"]["losses"], strict=True))
    ratio = runs["ddp"]["tokens_per_s"] / runs["plain"]["tokens_per_s"]
    result = {"backend": backend, "compile": args.compile, "steps": args.steps, "accumulation": 2, "runs": runs,
              "ddp_over_plain": ratio, "max_relative_difference": worst, "group_collectives": GroupCollectives.calls}
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"trainer-ddp1: {backend}{', compiled' if args.compile else ''}, {args.steps} steps: DDP in the group "
          f"{runs['ddp']['tokens_per_s']:,.0f} tok/s = {ratio:.3f}x the plain Trainer's "
          f"{runs['plain']['tokens_per_s']:,.0f}; losses within {worst:.2e}; {GroupCollectives.calls} of the loop's "
          f"collectives through the group")
    if not runs["ddp"]["ddp"] or worst > 1e-3:
        print(f"error: trainer-ddp1: DDP's losses differ from the plain Trainer's by up to {worst:.2e} (relative)"
              if runs["ddp"]["ddp"] else "error: trainer-ddp1: the Trainer in the group ran without DDP")
        return 1
    return 0


def profiled_step(model, optimizer, scaler, batch, dtype, device) -> dict:
    """One more optimizer step under torch.profiler: the 10 kernels (CUDA) or ops (CPU) that took the most time,
    and whether a flash-attention kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    from minilm.step import optimizer_step

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        float(optimizer_step(model, optimizer, scaler, [batch], lr=1e-4, grad_clip=1.0, dtype=dtype).loss)
    events = prof.key_averages()
    if device.type == "cuda":
        timed = [(e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) for e in events]
        timed = [(k, t) for k, t in timed if t > 0 and not k.startswith(("aten::", "cuda", "Memcpy", "Memset"))]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    top = sorted(timed, key=lambda kt: -kt[1])[:10]
    names = [e.key.lower() for e in events]
    return {"top": [{"name": k[:120], "us": round(t, 1)} for k, t in top], "of": device.type,
            "flash": any("flash" in n for n in names)}


def tf32_state() -> dict:
    """TF32 as both the legacy getters and the torch >= 2.9 ones report it; a getter that raises is a failure (a
    mix of the two setter APIs makes torch refuse the legacy reads, which Inductor's autotuning makes)."""
    import torch

    getters = {
        "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
        "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "torch.backends.cudnn.allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    }
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        getters["torch.backends.cuda.matmul.fp32_precision"] = lambda: torch.backends.cuda.matmul.fp32_precision
        getters["torch.backends.cudnn.conv.fp32_precision"] = lambda: torch.backends.cudnn.conv.fp32_precision
    state = {}
    for name, get in getters.items():
        try:
            state[name] = get()
        except Exception as e:  # noqa: BLE001  (what torch raises here is a RuntimeError today)
            state[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return state


def process_age() -> float | None:
    """Seconds since this process started (python, then the imports of torch and minilm), from /proc."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def preflight(argv: list[str]) -> int:
    """The check's first part and its cold start, measured: versions, the start's phases, and the gates. A closed
    gate is a result ("gates": what it closes and why), not a failure: the check skips what is behind it."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check preflight")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    started_s = process_age()
    import torch

    from minilm.step import configure_backends

    device = torch.device(args.device)
    found: dict = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
                   "phases_s": {"process_start": started_s}}
    gates: dict[str, str | None] = {"ray": None, "compile": None, "flash": None}

    def timed(phase: str, fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            found["phases_s"][phase] = time.perf_counter() - t0

    if device.type == "cuda":
        timed("cuda_context", lambda: torch.ones(1, device=device).add_(1).item())
        found["gpu"] = torch.cuda.get_device_name(device)
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        found["driver"] = nvidia_driver()
    for name in ("triton", "ray", "numpy", "pyarrow", "tokenizers"):
        found[name] = __import__(name).__version__ if importlib.util.find_spec(name) else None
    if found["ray"] is None:
        gates["ray"] = "no ray in this python (bash bench/gpu_bundle.sh, then bench/gpu_check.sh --bundle DIR)"
    else:
        try:
            timed("import_ray", lambda: (importlib.import_module("ray.data"), importlib.import_module("ray.train.torch")))
        except Exception as e:  # noqa: BLE001  (a broken bundle shows up as any import error)
            gates["ray"] = f"import ray.train.torch, ray.data: {type(e).__name__}: {str(e)[:200]}"
    configure_backends(device)
    found["tf32"] = tf32_state()
    raising = [f"{k} {v}" for k, v in found["tf32"].items() if str(v).startswith("raises")]
    if raising:  # Inductor's autotuning reads these getters
        gates["compile"] = "; ".join(raising)
    elif device.type == "cuda":  # Triton's first compilation; on CPU (C++) the compiled rows are the first anyway
        try:
            found["compile_s"] = timed("compile", lambda: tiny_compiled_step(device))
        except Exception as e:  # noqa: BLE001
            gates["compile"] = f"compiled forward+backward on {device.type}: {type(e).__name__}: {str(e)[:200]}"
    if device.type == "cuda":
        try:
            timed("flash", lambda: flash_at_check_shape(device))
            found["sdpa_flash"] = "runs at (32, 8, 512, 64) bf16 causal"
        except Exception as e:  # noqa: BLE001
            gates["flash"] = f"SDPA's flash kernel at the check's shape: {type(e).__name__}: {str(e)[:200]}"
    found["gates"] = gates
    parts = [f"torch {found['torch']}", f"python {found['python']}"]
    parts += [f"{k} {found[k]}" for k in ("gpu", "capability", "cuda", "driver", "triton", "ray", "numpy", "pyarrow")
              if found.get(k)]
    parts += [f"compile {found['compile_s']:.1f} s"] if "compile_s" in found else []
    found["line"] = ", ".join(parts)
    Path(args.json).write_text(json.dumps(found, indent=2) + "\n")
    print(f"preflight: {found['line']}")
    print("  cold start: " + ", ".join(f"{k} {v:.1f} s" for k, v in found["phases_s"].items() if v is not None))
    for name, value in found["tf32"].items():
        print(f"  {name}: {value}")
    for name, why in gates.items():
        if why:
            print(f"  gate {name} closed: {why}")
    return 0


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0] if out else None


def tiny_compiled_step(device) -> float:
    """A 2-layer MiniMind block stack compiled the way the training loop compiles it, one forward+backward."""
    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import prepare_model

    t0 = time.perf_counter()
    cfg = ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=256, max_position_embeddings=65)
    model = prepare_model(MiniMindForCausalLM(cfg).to(device).train(), TrainConfig(compile=True), device)
    ids = torch.randint(0, 256, (2, 65), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        out = model(ids[:, :-1], targets=ids[:, 1:])
    out.loss.backward()
    if not torch.isfinite(out.loss):
        raise RuntimeError(f"non-finite loss {float(out.loss)}")
    return time.perf_counter() - t0


def flash_at_check_shape(device) -> None:
    """SDPA restricted to the flash kernel at the 26M rows' attention shape: raises if that kernel cannot run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(32, 8, 512, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    torch.cuda.synchronize(device)


# ---- the table ----------------------------------------------------------------------------------------------

ROW_CHECKS = {name: check for name, (_, _, check) in ROWS.items()}


def table_rows(parts: dict[str, Part], fig: dict, gpu: bool) -> list[dict]:
    """One row per check: what was measured, the goal, and PASS / BELOW GOAL (a GPU run), `dry run` (CPU), or the
    part's failure (FAILED, TIMEOUT, STOPPED, SKIPPED with its reason)."""
    rows = []

    def add(check: str, part: str, result: str, goal: str = "-", ok: bool | None = None) -> None:
        done = parts.get(part, Part(part, note="not in this run's plan"))
        if done.status != "ok":
            result, status = done.note or "not run", done.status.upper()
        elif ok is None:
            status = "-" if gpu else "dry run"
        else:
            status = ("PASS" if ok else "BELOW GOAL") if gpu else "dry run"
        rows.append({"check": check, "status": status, "goal": goal, "result": result})

    add("preflight", "preflight", (fig.get("preflight") or {}).get("line", ""))
    measured = fig.get("rows") or {}
    for name, check in ROW_CHECKS.items():
        found = measured.get(name)
        goal = MFU_GOALS.get(name.split("-")[1]) if name.startswith("step-") and name.endswith("-compiled") else None
        if found is None:
            add(check, name, "", f">= {goal:.0%} MFU" if goal else "-")
            continue
        mfu = found["mfu_datasheet"] if found["mfu_datasheet"] is not None else found["mfu"]
        add(check, name, describe_row(found), f">= {goal:.0%} MFU" if goal else "-", None if goal is None else mfu >= goal)

    fp16 = fig.get("fp16")
    if fp16:
        changes = "; ".join(f"step {c['step']} {c['from']:g}->{c['to']:g}" for c in fp16["scale_changes"]) or "none"
        checks = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in fp16["checks"].items())
        rows.append({"check": f"fp16 + GradScaler, {len(fp16['steps'])} steps",
                     "status": "PASS" if fp16["passed"] else "FAILED", "goal": "finite, loss falls, overflow skipped",
                     "result": f"loss {fp16['loss_first10']:.2f} -> {fp16['loss_last10']:.2f}, "
                               f"{fp16['skipped_steps']} skipped, scale changes: {changes}; {checks}"})
    else:
        add("fp16 + GradScaler", "fp16", "")

    ddp = fig.get("ddp1")
    add("DDP in a 1-rank group (NCCL; gloo on CPU), 26M, accumulation 2", "ddp1-26m",
        "" if not ddp else f"{ddp['backend']}{', compiled' if ddp['compile'] else ''}: {ddp['steps']} steps, losses "
                           f"within {ddp['max_relative_difference']:.1e} of the plain model's",
        "the plain model's losses (1e-3)", None if not ddp else ddp["max_relative_difference"] <= 1e-3)
    tddp = fig.get("trainer_ddp1")
    add("Trainer in a 1-rank group, DDP (NCCL; gloo on CPU), 26M", "trainer-ddp1-26m",
        "" if not tddp else f"{tddp['backend']}{', compiled' if tddp['compile'] else ''}: "
                            f"{tddp['runs']['ddp']['tokens_per_s']:,.0f} tok/s = {tddp['ddp_over_plain']:.3f}x the "
                            f"plain Trainer's, losses within {tddp['max_relative_difference']:.1e}",
        f">= {DDP1_GOAL:.2f}x the plain Trainer", None if not tddp else tddp["ddp_over_plain"] >= DDP1_GOAL)
    ckpt, step = fig.get("checkpoint"), measured.get("step-104m-compiled") or measured.get("step-104m-eager")
    every = TrainConfig().checkpoint_every
    share = ckpt["save_s"] / (ckpt["save_s"] + every * step["step_s_median"]) if ckpt and step else None
    add("checkpoint save + restore, 104M", "checkpoint-104m",
        "" if not ckpt else f"save {ckpt['save_s']:.2f} s, restore {ckpt['restore_s']:.2f} s"
        + (f"; {share:.2%} of wall time at checkpoint_every {every} (the 104M step)" if share is not None else ""),
        "< 2% of wall time", None if share is None else share < 0.02)

    stall = fig.get("checkpoint_stall")
    add("checkpoint stall per save, sync vs async, 104M", "checkpoint-stall-104m",
        "" if not stall else f"sync {stall['sync_stall_s']:.3f} s, async {stall['async_stall_s']:.3f} s "
                             f"({stall['async_stall_s'] / stall['sync_stall_s']:.1%}), written in the background in "
                             f"{stall['async_write_s']:.2f} s",
        "async < 10% of sync", None if not stall else stall["async_stall_s"] < 0.1 * stall["sync_stall_s"])

    eager = measured.get("step-26m-eager")
    job = fig.get("ray_job") or {"halves": {}}
    for run, check, part in ((fig.get("trainer"), "Trainer in-process (minilm.train), 26M", "trainer"),
                             (job["halves"].get("first"), "Ray job 1 worker, 26M, to half its steps", "ray-job"),
                             (job["halves"].get("resumed"), "  resumed to the end", "ray-job-resume")):
        ratio = run["tokens_per_s"] / eager["tokens_per_s"] if run and eager else None
        result = "" if not run else f"{run['tokens_per_s']:,.0f} tok/s" + (
            f" = {ratio:.3f}x the eager step" if ratio else "")
        if part == "ray-job-resume" and "ray-job-resume" in parts:
            result += f"; {parts['ray-job-resume'].note}"
        add(check, part, result, f">= {RAY_GOAL:.2f}x the eager step", None if ratio is None else ratio >= RAY_GOAL)
    add("prepare the demo corpus", "prepare", parts["prepare"].note if "prepare" in parts else "", "completes")
    add("export + sample", "sample", repr((fig.get("sample") or "")[:80]), "text comes out")
    fastest = measured.get("step-26m-compiled") or eager
    stream, need = fig.get("stream"), fastest["tokens_per_s"] if fastest else None
    add("Ray Data stream delivery", "stream", f"{stream['tokens_per_s']:,.0f} tok/s to {stream['to']} ({stream['by']})"
        if stream else "no rate found", f">= {need:,.0f} tok/s (the 26M step)" if need else "-",
        None if not stream or not need else stream["tokens_per_s"] >= need)
    return rows


def format_table(rows: list[dict]) -> str:
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in ("check", "status", "goal")}
    lines = [f"{'check':<{widths['check']}}  {'status':<{widths['status']}}  {'goal':<{widths['goal']}}  result"]
    for r in rows:
        lines.append(f"{r['check']:<{widths['check']}}  {r['status']:<{widths['status']}}  "
                     f"{r['goal']:<{widths['goal']}}  {r['result']}")
    return "\n".join(lines)


# ---- the results ------------------------------------------------------------------------------------------

def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_results(dest: Path, runner: Runner, fig: dict, head: dict, gpu: bool, final: str = "") -> list[dict]:
    """Rewrite the three result files from what is known now (after every part, and at the end)."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = table_rows(runner.parts, fig, gpu)
    parts = {k: {"status": v.status, "wall_s": v.wall_s, "limit_s": runner.limits.get(k), "note": v.note}
             for k, v in runner.parts.items()}
    plan = head["plan"]
    payload = {**head, "plan": {"budget_s": plan.budget, "total_s": plan.total, "scale": plan.scale,
                                "parts": plan.parts, "left": plan.left, "added": plan.added},
               "table": rows, "figures": fig, "parts": parts, "finished": final}
    write_atomic(dest / FILES[0], (json.dumps(payload, indent=2, default=str) + "\n").encode())
    failed = failed_parts(runner, fig)
    summary = [head["title"], "", format_table(rows), ""]
    summary += [f"failed: {', '.join(failed)}"] if failed else []
    summary += [final or f"in progress: {len(runner.parts)} part(s) done"]
    write_atomic(dest / FILES[1], ("\n".join(summary) + "\n").encode())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for folder in (runner.logs, runner.results):
            tar.add(folder, arcname=folder.name)
    write_atomic(dest / FILES[2], buf.getvalue())
    return rows


def failed_parts(runner: Runner, fig: dict) -> list[str]:
    failed = [p.name for p in runner.parts.values() if p.status in ("failed", "timeout", "stopped")]  # not: left
    failed += [] if not fig.get("fp16") or fig["fp16"]["passed"] else ["fp16"]
    return list(dict.fromkeys(failed))


# ---- main ---------------------------------------------------------------------------------------------------

def blocked(c: Check, spec: Spec) -> str | None:
    """Why a part cannot run now (a closed gate, a part it needs that did not succeed), or None."""
    if spec.ray and "ray" in c.gates:
        return f"Ray gate closed: {c.gates['ray']}"
    if spec.name in ROWS and "--compile" in ROWS[spec.name][1] and "compile" in c.gates:
        return f"compile gate closed: {c.gates['compile']}"
    for need in spec.needs:
        done = c.r.parts.get(need)
        if done is None or done.status != "ok":
            return f"needs {need}, which {'did not run' if done is None else done.status}"
    return None


def join_ray(c: Check, ray: LocalRay) -> None:
    """Start (or join) the one Ray of the Ray parts; a failure closes the Ray gate."""
    missing = missing_modules(RAY_MODULES)
    if missing:
        c.gates["ray"] = (f"needs {', '.join(missing)} in this python: build the bundle (bash bench/gpu_bundle.sh) "
                          f"and run bash bench/gpu_check.sh --bundle gpu-bundle")
        return
    try:
        c.r.env["RAY_ADDRESS"] = ray.address(c.device == "cuda")
    except Exception as e:  # noqa: BLE001  (whatever ray.init raises, the Ray parts cannot run)
        c.gates["ray"] = f"could not start a local Ray: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        return
    c.fig["ray"] = ray.info
    # ray.init turns token auth on for the Ray it starts and says so in this process's environment only; the parts'
    # drivers also take LocalRay's settings
    c.r.env.update({k: v for k, v in os.environ.items()
                    if k.startswith(("RAY_AUTH", "RAY_memory_monitor", "RAY_ENABLE_WINDOWS_OR_OSX"))})


def replan(c: Check, plan: Plan, queue: list[tuple[str, float]], only: set[str] | None) -> list[tuple[str, float]]:
    """After the preflight (the cold start, measured): if it took longer than assumed, every later limit grows by
    as much (up to 2x) and the rest is planned again within the time left; what no longer fits is left."""
    part = c.r.parts.get("preflight")
    scale = part.wall_s / ASSUME[c.device].cold_start if part is not None and part.status == "ok" else 1.0
    if scale <= 1.1:
        return queue
    left_s = c.r.deadline - time.monotonic()
    new = make_plan(c.device, left_s, only, done=tuple(c.r.parts), scale=min(scale, 2.0), compiled={"tiny"})
    print(f"[plan] the cold start took {part.wall_s:.0f} s, {scale:.1f}x the {ASSUME[c.device].cold_start:g} s "
          f"assumed: the rest re-planned within the {left_s:.0f} s left", flush=True)
    print("\n".join(new.lines()[2:]), flush=True)
    plan.scale, plan.parts, plan.left = new.scale, [*plan.parts[:1], *new.parts], [*plan.left, *new.left]
    mark_left(c, new)
    c.r.limits.update(dict(new.parts))
    return list(new.parts)


def mark_left(c: Check, plan: Plan) -> None:
    for name, limit in plan.left:
        c.r.parts[name] = Part(name, "left", note=f"left for a rerun (its {limit:.0f} s limit did not fit): --only {name}")


def run_parts(c: Check, plan: Plan, ray: LocalRay, only: set[str] | None) -> None:
    """The plan's parts in order, each as its gates and needs allow; the local Ray from the first Ray part to the
    last."""
    queue = list(plan.parts)
    c.r.limits.update(dict(queue))
    mark_left(c, plan)
    while queue:
        name, _ = queue.pop(0)
        spec = SPEC[name]
        if spec.ray and "ray" not in c.gates and "RAY_ADDRESS" not in c.r.env:
            join_ray(c, ray)
        why = blocked(c, spec)
        if why:
            c.r.skip(name, why)
        else:
            PART_RUNS[name](c)
        if name == "preflight":
            queue = replan(c, plan, queue, only)
        if ray.started and not any(SPEC[n].ray for n, _ in queue):
            ray.stop()  # the rest runs without Ray's processes beside it
            c.r.env.pop("RAY_ADDRESS", None)


def check(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run (tiny configs)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for the parts (default {BUDGET['cuda']} on the GPU, {BUDGET['cpu']} for the dry run)")
    p.add_argument("--only", default=None, help="comma-separated part names: run these (and what they need) alone")
    p.add_argument("--plan", action="store_true", help="print the plan (the parts, their limits, the total) and exit")
    p.add_argument("--keep-work", action="store_true", help="keep the data, runs, logs and export (a temporary folder)")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(SPEC):
        print(f"error: --only: unknown part(s) {', '.join(sorted(only - set(SPEC)))}; parts: {', '.join(SPEC)}",
              file=sys.stderr)
        return 2
    budget = args.budget or BUDGET[args.device]
    plan = make_plan(args.device, budget, only)
    if args.plan:
        print("\n".join(plan.lines()))
        return 0
    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("error: torch sees no CUDA device (a CPU-only torch build, or no GPU); --device cpu is the dry run",
              file=sys.stderr)
        return 2
    s = GPU if gpu else CPU
    dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else results_dir()
    env = environment()
    title = (f"# GPU check on {env.get('gpu', 'no GPU') if gpu else env['cpu'] + ' (CPU dry run)'}, {env['cpus']} "
             f"CPUs, torch {env['torch']}, python {env['python']}, {env['time']}")
    print(title, flush=True)
    print("\n".join(plan.lines()), flush=True)
    head = {"title": title, "environment": env, "device": args.device, "plan": plan}
    work = Path(tempfile.mkdtemp(prefix="minilm-gpu-check-"))
    ray = LocalRay(s.object_store_bytes)
    runner = Runner(sys.executable, budget, work, {**os.environ, "PYTHONUNBUFFERED": "1"})
    c = Check(runner, s, args.device, work, {})
    runner.after_part = lambda: save_results(dest, runner, c.fig, head, gpu)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    final = "finished"
    try:
        run_parts(c, plan, ray, only)
    except Stopped as e:
        final = f"stopped by {e} during {next(reversed(runner.parts), 'the start')}"
        print(f"\n{final}", flush=True)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the results are written once, whatever comes next
        runner.kill_all()
        ray.stop()
        rows = save_results(dest, runner, c.fig, head, gpu, final)
        if args.keep_work:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(format_table(rows))
    failed = failed_parts(runner, c.fig)
    print(f"wrote {', '.join(str(dest / f) for f in FILES)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    if plan.left:
        print(f"left for a rerun: python -m bench.gpu_check --only {','.join(n for n, _ in plan.left)}")
    return 1 if failed or final != "finished" else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"stream-rate": stream_rate, "row": row, "preflight": preflight, "ddp1": ddp1,
                "trainer-ddp1": trainer_ddp1}
    if argv[:1] and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return check(argv)


if __name__ == "__main__":
    sys.exit(main())
