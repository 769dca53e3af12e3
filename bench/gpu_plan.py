"""The GPU check's plan: its parts in order of value, each one's limit from the cold start assumed, the configs of
the GPU run and of the CPU dry run (docs/gpu.md says why each number is what it is), and the runner that holds each
part, a subprocess in its own process group, to its limit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_GOAL = 0.97  # the Ray job's tokens/s over the eager step's, same config
DDP1_GOAL = 0.97  # the Trainer's tokens/s under DDP in a 1-rank group over the plain Trainer's
RAY_MODULES = ("ray", "pyarrow", "tokenizers", "yaml")
FILES = ("gpu_check.json", "gpu_check-summary.txt", "gpu_check-logs.tar.gz")
# The lent machine: device time per task including its cold start, one command's limit. One command installs the
# bundle, runs the check and writes its results; the device time left after that is a rerun's (`--only`).
DEVICE_S, COMMAND_S = 900, 600
MACHINE_START_S, INSTALL_S, RESULTS_S = 150, 30, 30  # "a minute or more" to start; pip of ~40 MB of wheels
# Seconds for the parts. The CPU dry run's is a cap only (it takes ~3 minutes): room for a CI box 2x slower than
# this one, whose slower cold start rescales every limit (`gpu_check.rescale`), with every part still in the plan.
BUDGET = {"cuda": COMMAND_S - INSTALL_S - RESULTS_S, "cpu": 2400}
SPARE = 0.2  # of the budget no plan uses: the limits are estimates, and the machine may be slower still


@dataclass
class Part:
    name: str
    status: str = "skipped"  # ok | failed | timeout | stopped | skipped | left
    wall_s: float = 0.0
    note: str = ""
    output: str = ""


# The cold start assumed (the preflight's wall: the first process, on a cold disk): GPU, issue #34's reading (torch
# cu130 from a cold disk, the CUDA context, Ray Train/Data, a first compiled forward+backward); CPU, this rehearsal's
# (bench/RESULTS.md). A slower preflight rescales every later limit by as much (`gpu_check.rescale`).
COLD_START_S = {"cuda": 30, "cpu": 6}


@dataclass(frozen=True)
class Spec:
    """One part of the check: its limits in seconds (GPU, CPU dry run), 1.5x (GPU) or 3x (CPU, a shared 2-core CI
    box) its process start (8 s, 3 s) + work + compilation (a new block graph 30 s / 20 s, one from Inductor's cache
    8 s / 6 s) + a Ray Train start (20 s / 18 s), rounded up to 5 s. A row (`row`: its shape and the flags of `python
    -m bench.gpu_check row`) is one optimizer step's configuration, `check` its line in the table."""

    name: str
    limits: tuple[float, float]
    what: str
    ray: bool = False  # it runs in or against the local Ray (needs the bundle on the lent machine)
    needs: tuple[str, ...] = ()  # parts whose results it takes
    headline: bool = False  # a goal's figure: it starts whatever the preflight took, with the time there is
    row: tuple[str, tuple[str, ...]] | None = None
    check: str = ""


# In the order of value: the preflight, the headline rows, the parts never run on a GPU, the refinements.
SPECS = (
    Spec("preflight", (45, 20), "versions, cold start; gates: Ray import, compile"),
    Spec("step-104m-compiled", (65, 75), "headline: 104M, the whole model compiled, MFU goal 45%", headline=True,
         row=("large", ("--compile", "model")), check="step 104M bf16 compiled"),
    Spec("step-26m-compiled", (65, 80), "headline: 26M, the whole model compiled, MFU goal 30%; a profiled step",
         headline=True, row=("small", ("--compile", "model", "--profile")), check="step 26M bf16 compiled"),
    Spec("trainer-ddp1-26m", (40, 75), "never run: the Trainer DDP-wrapped in an NCCL group"),  # CPU: bf16 emulated on AVX2
    Spec("moe-26m-compiled", (65, 75), "never run: the grouped MoE dispatch, compiled",
         row=("small", ("--moe", "--compile")), check="step 26M MoE 4x top-1 bf16 compiled"),
    Spec("checkpoint-stall-104m", (35, 30), "never run: the async checkpoint's stall on the device"),
    Spec("step-26m-eager", (20, 15), "the 26M eager step: the Trainer's and the Ray job's reference",
         row=("small", ()), check="step 26M bf16 eager"),
    Spec("ray-start", (30, 45), "the local Ray of the Ray parts, started in its own process", ray=True),
    Spec("prepare", (25, 35), "the demo corpus through Ray Data", ray=True, needs=("ray-start",)),
    Spec("ray-job", (55, 150), "never run: the 1-GPU Ray job, half", ray=True, needs=("prepare",)),
    Spec("ray-job-resume", (55, 150), "never run: ... resumed to the end", ray=True, needs=("ray-job",)),
    Spec("docmask-26m-compiled", (65, 75), "--document-mask, compiled", row=("small", ("--document-mask", "--compile")),
         check="step 26M --document-mask compiled"),
    Spec("muon-26m-compiled", (30, 35), "Muon, compiled", row=("small", ("--optimizer", "muon", "--compile")),
         check="step 26M Muon compiled"),
    Spec("ac-104m-compiled", (70, 75), "activation checkpointing at 104M, compiled",
         row=("large", ("--activation-checkpointing", "--compile")), check="step 104M activation checkpointing compiled"),
    Spec("step-104m-eager", (20, 15), "104M eager", row=("large", ()), check="step 104M bf16 eager"),
    Spec("moe-26m-eager", (20, 15), "MoE eager (split dispatch on CPU)", row=("small", ("--moe",)),
         check="step 26M MoE 4x top-1 bf16 eager"),
)
SPEC = {s.name: s for s in SPECS}
ROWS = {s.name: s for s in SPECS if s.row}


def users(name: str, among) -> list[str]:
    """The parts among `among` that take `name`'s results."""
    return [n for n in among if name in SPEC[n].needs]


@dataclass
class Plan:
    """The parts sure to run (their limits fit (1 - SPARE) of the budget) and the rest, run as time allows."""

    device: str
    budget: float
    parts: list[tuple[str, float]]  # (part, limit) in the order they run
    left: list[tuple[str, float]]  # the parts that start only if the time left allows, in order
    added: list[str]  # parts --only did not name but a named one needs
    scale: float = 1.0

    @property
    def total(self) -> float:
        return sum(limit for _, limit in self.parts)

    @property
    def limits(self) -> dict[str, float]:
        return dict(self.parts + self.left)

    def lines(self) -> list[str]:
        lines = [f"# plan ({'the lent GPU' if self.device == 'cuda' else 'the CPU dry run'}): parts in order of value, "
                 f"each with its limit; the first call's parts fit {1 - SPARE:.0%} of the {self.budget:.0f} s budget",
                 f"#   limits from a cold start of {COLD_START_S[self.device]} s (`Spec`), rescaled by the measured one"]
        if self.device == "cuda":
            lines.append(f"#   device time {DEVICE_S} s = machine start {MACHINE_START_S} + one command {COMMAND_S} "
                         f"(bundle install {INSTALL_S}, the check {self.budget:.0f}, results {RESULTS_S}) + "
                         f"{DEVICE_S - MACHINE_START_S - COMMAND_S} s for a rerun of what is left")
        lines += [f"  {i:2d}. {n:<22} {limit:5.0f} s  {SPEC[n].what}" for i, (n, limit) in enumerate(self.parts, 1)]
        if self.added:
            lines.append(f"  added for --only: {', '.join(self.added)} (needed by the parts named)")
        if self.left:
            lines.append(f"  then, each as the time left allows: {', '.join(f'{n} {lim:.0f} s' for n, lim in self.left)}"
                         f"; what none reaches: python -m bench.gpu_check --only PARTS")
        return [*lines, f"total {self.total:.0f} s of {self.budget:.0f} s"]


def make_plan(device: str, budget: float, only: set[str] | None = None) -> Plan:
    """The parts (all, or `only` and what they need) in SPECS order, split into sure and left (`Plan`)."""
    wanted, todo = set(), list(only or SPEC)
    while todo:  # the parts named and what they need
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(SPEC[name].needs)
    names = [s.name for s in SPECS if s.name in wanted]
    limits = {n: float(SPEC[n].limits[device != "cuda"]) for n in names}
    sure: list[str] = []
    for name in names:
        fits = sum(limits[n] for n in sure) + limits[name] <= (1 - SPARE) * budget
        if SPEC[name].headline or fits and all(n in sure for n in SPEC[name].needs):
            sure.append(name)
    for name in reversed(names):  # a part kept only for its users goes when they all went
        if name in sure and users(name, names) and not users(name, sure):
            sure.remove(name)
    return Plan(device, budget, [(n, limits[n]) for n in sure], [(n, limits[n]) for n in names if n not in sure],
                sorted(wanted - only) if only else [])


@dataclass
class Shapes:
    """The configs of one check: the real ones on a GPU, tiny ones for the CPU dry run."""

    small: dict  # MiniMind-26M: the rows, the Trainer, the Ray job
    large: dict  # MiniMind-104M: the rows only
    job_steps: int  # the Ray job's optimizer steps (it exits halfway and resumes)
    row_args: list[str]  # the rows' timing flags
    corpus_bytes: int | None  # the demo corpus, cut to this size (None: whole)
    ddp_args: list[str] = field(default_factory=list)  # trainer-ddp1's
    row_extra: dict = field(default_factory=dict)  # more flags for one row on this device
    cpus_per_worker: int = 4  # the Ray job's worker: 4 of the lent machine's 16 cores, the rest for Ray Data
    object_store_bytes: int = 2 << 30  # the local Ray's, fixed (gpu_parts.ray_keeper)


GPU = Shapes(
    small={"hidden_size": 512, "num_hidden_layers": 8, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 32},
    large={"hidden_size": 768, "num_hidden_layers": 16, "vocab_size": 6400, "seq_len": 512, "micro_batch_size": 128},
    job_steps=200, row_args=["--steps", "20", "--warmup", "5"],
    corpus_bytes=None, ddp_args=["--compile", "--steps", "40"])
CPU = Shapes(
    small={"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    large={"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 512, "seq_len": 64, "micro_batch_size": 4},
    job_steps=8, row_args=["--steps", "2", "--warmup", "1", "--peak-size", "256"],
    corpus_bytes=200_000, ddp_args=["--steps", "6"],
    # CPU has no sync-free grouped_mm, so "auto" splits there: the rehearsal compiles the grouped dispatch itself
    row_extra={"moe-26m-compiled": ["--moe-dispatch", "grouped"]}, cpus_per_worker=1, object_store_bytes=256 << 20)


# ---- running a part ---------------------------------------------------------------------------------------

class Stopped(BaseException):
    """A signal (SIGTERM from `timeout`, SIGINT, SIGHUP) asked the check to stop."""


def on_signal(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


class Runner:
    """Runs each part as a subprocess in its own process group with its limit, never past the budget (`clock`: a
    fake one in tests); its output to work/logs/<part>.log, then `after_part` (the results rewritten)."""

    def __init__(self, python: str, budget_s: float, work: Path, env: dict, after_part=None, clock=time.monotonic):
        self.python, self.clock, self.work, self.env = python, clock, work, env
        self.deadline = clock() + budget_s
        self.logs, self.results = work / "logs", work / "results"
        self.parts: dict[str, Part] = {}
        self.limits: dict[str, float] = {}
        self.groups: list[int] = []  # every part's process group, killed again at exit
        self.kept: subprocess.Popen | None = None  # a part that stays up for the parts after it (the local Ray)
        self.after_part = after_part or (lambda: None)
        for folder in (self.logs, self.results):
            folder.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - self.clock()

    def skip(self, name: str, why: str, status: str = "skipped") -> Part:
        part = self.parts[name] = Part(name, status, note=why)
        print(f"[{name}] {status}: {why}", flush=True)
        return part

    def run(self, name: str, args: list[str], env: dict | None = None, ready: Path | None = None) -> Part:
        """The part to its end, or until it writes `ready`: it then stays up (`kept`) until `stop_kept`."""
        if self.left() < 5:
            return self.skip(name, "out of time (--budget)")
        timeout, t0, status = min(self.limits[name], self.left()), self.clock(), None
        print(f"[{name}] {' '.join(args)}  (limit {timeout:.0f} s)", flush=True)
        with (self.logs / f"{name}.log").open("w+") as log:
            proc = subprocess.Popen([self.python, *args], stdout=log, stderr=subprocess.STDOUT, text=True,
                                    env={**self.env, **(env or {})}, start_new_session=True)
            self.groups.append(proc.pid)
            try:
                status = wait(proc, ready, timeout)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                status = "timeout"
            except BaseException:  # Stopped: the part in flight goes first, then the check writes its results
                stop_group(proc, grace_s=5)
                status = "stopped"
                raise
            finally:
                if status != "ok" or not ready:
                    kill_group(proc.pid)  # what the part left behind in its group (a local Ray's processes, say)
                log.seek(0)
                out = log.read()
                note = {"failed": f"exit {proc.returncode}: {last_line(out)}", "stopped": "stopped by a signal",
                        "timeout": f"stopped at its {timeout:.0f} s limit"}.get(status, "")
                self.parts[name] = part = Part(name, status, self.clock() - t0, note, out)
        self.kept = proc if ready and status == "ok" else self.kept
        print(f"[{name}] {status} in {part.wall_s:.0f} s{': ' + note if note else ''}", flush=True)
        self.after_part()
        return part

    def stop_kept(self) -> None:
        if self.kept is not None:
            stop_group(self.kept)
            kill_group(self.kept.pid)
            self.kept = None

    def record(self, part: Part) -> None:
        (self.logs / f"{part.name}.log").write_text(part.output)
        self.parts[part.name] = part

    def kill_all(self) -> None:
        for pgid in self.groups:
            kill_group(pgid)


def wait(proc: subprocess.Popen, ready: Path | None, timeout: float) -> str:
    """Wait until the process ends (its exit status decides), writes `ready` ("ok"), or `timeout` passes."""
    t0 = time.monotonic()
    while not (ready and ready.is_file()):
        if proc.poll() is not None:
            return "failed" if proc.returncode else "ok"
        if time.monotonic() - t0 > timeout:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.1)
    return "ok"


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM to the part's process group (a Ray driver then shuts down what it started), SIGKILL after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1][:200]
