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


@dataclass
class Part:
    name: str
    status: str = "skipped"  # ok | failed | timeout | stopped | skipped
    wall_s: float = 0.0
    note: str = ""
    output: str = ""



# ---- the plan ---------------------------------------------------------------------------------------------------

# The lent machine: device time per task including its cold start, one command's limit. One command installs the
# bundle, runs the check and writes its results; the device time left after that is a rerun's (`--only`).
DEVICE_S, COMMAND_S = 900, 600
MACHINE_START_S, INSTALL_S, RESULTS_S = 150, 30, 30  # "a minute or more" to start; pip of ~40 MB of wheels
# Seconds for the parts. The CPU dry run's is a cap only (it takes ~3 minutes): room for a CI box 2x slower than
# this one, whose slower cold start rescales every limit (`gpu_check.rescale`), with every part still in the plan.
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
    """One part of the check, in the order of value: the preflight, the headline rows, the parts never run on a GPU,
    the refinements."""

    name: str
    work: tuple[float, float]  # seconds once started (GPU, CPU dry run): steps, saves, reads
    graph: str | None = None  # the compiled block graph it compiles; the first part of each compiles it cold
    ray: bool = False  # it runs in or against the local Ray (needs the bundle on the lent machine)
    train: bool = False  # it starts a Ray Train run
    needs: tuple[str, ...] = ()  # parts whose results it takes
    headline: bool = False  # a goal's figure: it starts whatever the preflight took, with the time there is
    what: str = ""


SPECS = (
    Spec("preflight", (0, 0), graph="tiny", what="versions, cold start; gates: Ray import, compile"),
    Spec("step-104m-compiled", (5, 2), graph="104m", headline=True, what="headline: 104M compiled, MFU goal 45%"),
    Spec("step-26m-compiled", (4, 3), graph="26m", headline=True,
         what="headline: 26M compiled, MFU goal 30%; a profiled step"),
    Spec("ddp1-26m", (5, 3), what="never run: DDP over NCCL, an all-reduce on the device"),
    Spec("trainer-ddp1-26m", (8, 4), graph="26m", what="never run: the Trainer DDP-wrapped in an NCCL group"),
    Spec("moe-26m-compiled", (3, 2), graph="26m-moe", what="never run: the grouped MoE dispatch, compiled"),
    Spec("checkpoint-stall-104m", (15, 6), what="never run: the async checkpoint's stall on the device"),
    Spec("step-26m-eager", (4, 2), what="the 26M eager step: the Trainer's and the Ray job's reference"),
    Spec("ray-start", (10, 12), ray=True, what="the local Ray of the Ray parts, started in its own process"),
    Spec("prepare", (8, 8), ray=True, needs=("ray-start",), what="the demo corpus through Ray Data"),
    Spec("ray-job", (6, 3), ray=True, train=True, needs=("prepare",), what="never run: the 1-GPU Ray job, half"),
    Spec("ray-job-resume", (6, 3), ray=True, train=True, needs=("ray-job",), what="never run: ... resumed to the end"),
    Spec("export", (3, 2), needs=("ray-job-resume",), what="the last checkpoint exported"),
    Spec("sample", (3, 1), needs=("export",), what="text sampled from the export"),
    Spec("fp16", (10, 6), what="fp16 with the GradScaler: an overflow skipped"),
    Spec("docmask-26m-compiled", (3, 2), graph="26m-docmask", what="--document-mask, compiled"),
    Spec("muon-26m-compiled", (4, 2), graph="26m", what="Muon, compiled"),
    Spec("ac-104m-compiled", (6, 2), graph="104m-ac", what="activation checkpointing at 104M, compiled"),
    Spec("step-104m-eager", (5, 2), what="104M eager"),
    Spec("moe-26m-eager", (3, 2), what="MoE eager (split dispatch on CPU)"),
    Spec("trainer", (10, 8), what="minilm.train in-process, validation on the device"),  # CPU: its 12 steps, val and save took 16 s here
    Spec("checkpoint-104m", (15, 5), what="checkpoint save + restore at 104M"),
    Spec("stream", (8, 6), ray=True, needs=("prepare",), what="Ray Data stream delivery to the device"),
)
SPEC = {s.name: s for s in SPECS}


def users(name: str, among) -> list[str]:
    """The parts among `among` that take `name`'s results."""
    return [n for n in among if name in SPEC[n].needs]


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
    """The parts sure to run (`parts`: their limits fit (1 - SPARE) of the budget) and the rest in order (`left`),
    each started at run time when its limit fits the time left."""

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
        a = ASSUME[self.device]
        head = [f"# plan ({'the lent GPU' if self.device == 'cuda' else 'the CPU dry run'}): parts in order of value, "
                f"each limit = {a.margin:g} x (start + work + compile + Ray Train start); the first call's parts "
                f"fit {1 - SPARE:.0%} of the {self.budget:.0f} s budget",
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
            tail.append(f"  then, each as the time left allows: {', '.join(f'{n} {lim:.0f} s' for n, lim in self.left)}"
                        f"; what none reaches: python -m bench.gpu_check --only PARTS")
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
    """The parts (all, or `only` and what they need) in SPECS order, split into sure and left (`Plan`). `done`:
    parts not planned again (a re-plan after the preflight); `compiled`: graphs already compiled."""
    a = ASSUME[device]
    wanted = with_needs(only) if only else set(SPEC)
    cold_graphs = {s.graph for s in SPECS if s.graph} - set(compiled)
    names = [s.name for s in SPECS if s.name in wanted and s.name not in done]
    limits, sure, total = {}, [], 0.0
    for name in names:
        spec = SPEC[name]
        limits[name] = part_limit(spec, a, device, cold_graphs, scale)
        cold_graphs.discard(spec.graph)
        fits = total + limits[name] <= (1 - SPARE) * budget and all(n in sure or n in done for n in spec.needs)
        if spec.headline or fits:
            sure.append(name)
            total += limits[name]
    for name in reversed(names):  # a part kept only for its users goes when they all went
        if name in sure and users(name, names) and not users(name, sure):
            sure.remove(name)
    added = sorted(wanted - set(only)) if only else []
    return Plan(device, budget, [(n, limits[n]) for n in sure], [(n, limits[n]) for n in names if n not in sure],
                added, scale)


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
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - self.clock()

    def skip(self, name: str, why: str, status: str = "skipped") -> Part:
        part = self.parts[name] = Part(name, status, note=why)
        print(f"[{name}] {status}: {why}", flush=True)
        return part

    def run(self, name: str, args: list[str], env: dict | None = None, ready: Path | None = None) -> Part:
        """The part to its end, or with `ready` until it writes that file: it then stays up (`kept`) until
        `stop_kept`."""
        left = self.left()
        if left < 5:
            return self.skip(name, "out of time (--budget)")
        timeout = min(self.limits[name], left)
        print(f"[{name}] {' '.join(args)}  (limit {timeout:.0f} s)", flush=True)
        t0 = self.clock()
        log = (self.logs / f"{name}.log").open("w+") if ready else subprocess.PIPE  # a kept part outlives a pipe
        proc = subprocess.Popen([self.python, *args], stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**self.env, **(env or {})}, start_new_session=True)
        self.groups.append(proc.pid)
        status = None
        try:
            out, status = wait_ready(proc, ready, timeout) if ready else (proc.communicate(timeout=timeout)[0], None)
            status = status or ("ok" if proc.returncode == 0 else "failed")
        except subprocess.TimeoutExpired:
            out, status = stop_group(proc), "timeout"
        except BaseException:  # Stopped: the part in flight goes first, then the check writes its results
            out = stop_group(proc, grace_s=5)
            self.record(Part(name, "stopped", self.clock() - t0, note="stopped by a signal", output=out))
            raise
        finally:
            if status != "ok" or not ready:
                kill_group(proc.pid)  # what the part left behind in its group (a local Ray's processes, say)
        if ready:
            log.seek(0)
            out = log.read()
        self.kept = proc if ready and status == "ok" else self.kept
        part = Part(name, status, self.clock() - t0, output=out or "")
        if status == "failed":
            part.note = f"exit {proc.returncode}: {last_line(part.output)}"
        elif status == "timeout":
            part.note = f"stopped at its {timeout:.0f} s limit"
        self.record(part)
        print(f"[{name}] {status} in {part.wall_s:.0f} s{': ' + part.note if part.note else ''}", flush=True)
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


def wait_ready(proc: subprocess.Popen, ready: Path, timeout: float) -> tuple[str, str | None]:
    """Wait until the process writes `ready` ("ok"), ends first (its exit status decides), or `timeout` passes."""
    t0 = time.monotonic()
    while not ready.is_file():
        if proc.poll() is not None:
            return "", "failed" if proc.returncode else "ok"
        if time.monotonic() - t0 > timeout:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.2)
    return "", "ok"


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
