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
