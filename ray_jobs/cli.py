"""Command-line plumbing of the Ray entrypoints: the local Ray, printable URIs (the rest is `minilm.cli`'s)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from minilm.cli import DEMO_PRESET, ArgumentParser, UsageError, command, fail, load_yaml  # noqa: F401  (re-exported)
from minilm.options import TIMEOUT_HELP, RunOptions, option

from .ray_compat import quiet_token_auth_notice


def parse_num_workers(spec) -> tuple[int, int]:  # 'N' or 'MIN-MAX'
    try:
        lo, _, hi = str(spec).partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--num-workers {spec!r}: expected N or MIN-MAX, e.g. 2 or 2-8") from None
    if lo < 1 or hi < lo:
        raise UsageError(f"--num-workers {spec!r}: need 1 <= MIN <= MAX")
    return lo, hi


def apply_run_dir(args) -> None:
    """--run-dir DIR|URI (pretrain, tune) as the storage path and name that RayOptions holds (and YAML may give)."""
    if args.run_folder is None:
        return
    if args.storage_path is not None or args.name is not None:
        raise UsageError("--run-dir names the run folder: give it or the old --storage-path and --name, not both")
    path, _, query = args.run_folder.partition("?")  # a URI's ?query belongs to the storage, not the name
    storage, _, name = path.rstrip("/").rpartition("/")
    if not name or (storage + "/").endswith("://"):
        raise UsageError(f"--run-dir {args.run_folder!r}: expected a run folder, e.g. runs/run1 or s3://bucket/runs/run1")
    args.storage_path, args.name = (storage or ".") + (f"?{query}" if query else ""), name


def parse_cpus(value) -> float | None:  # --cpus-per-worker: auto (None) or a number > 0
    if value is None or str(value) == "auto":
        return None
    try:
        cpus = float(value)
    except ValueError:
        cpus = -1.0
    if not cpus > 0:
        raise UsageError(f"--cpus-per-worker must be auto or a number > 0, got {value!r}")
    return cpus


def parse_resource_list(spec, flag: str, example: str, reserved: tuple[str, ...] = ()) -> dict[str, float]:
    """'NAME=N,NAME=N' or a YAML mapping -> {NAME: N}; one UsageError line naming `flag` for anything else."""
    items = spec.items() if isinstance(spec, dict) else (part.partition("=")[::2] for part in str(spec).split(","))
    resources = {}
    for name, value in items:
        name = str(name).strip()
        try:
            amount = float(value)
        except (TypeError, ValueError):
            amount = -1.0
        if not name or not 0 < amount < float("inf") or name in reserved:
            why = (f" ({' and '.join(reserved)} have their own flags: --cpus-per-worker, --use-gpu)" if reserved
                   else "")
            raise UsageError(f"{flag} {spec!r}: expected NAME=N with N > 0, e.g. {example}{why}")
        resources[name] = amount
    return resources


def parse_resources(spec) -> dict[str, float]:  # --resources-per-worker 'slot=1,disk=2' -> {'slot': 1.0, 'disk': 2.0}
    return parse_resource_list(spec, "--resources-per-worker", "slot=1", ("CPU", "GPU")) if spec else {}


def parse_eval_resources(spec) -> dict[str, float]:  # --eval-resources 'CPU=2', 'CPU=1,GPU=1'
    return parse_resource_list(spec, "--eval-resources", "CPU=2 or CPU=1,GPU=1")


ELASTIC_MAX_FAILURES = 10  # --max-failures' default for a MIN-MAX range: a lost node is a failure, a growth is not


@dataclass
class RayOptions(RunOptions):
    """ray_jobs.pretrain's own flags (a Ray cluster's), and what its driver fills in for the workers."""

    data: str | None = option(help="a folder written by ray_jobs.prepare, or a remote URI; default: the built-in demo "
                                   "corpus, prepared once into ~/.cache/minilm")
    name: str | None = option(help="the run folder's name under --storage-path (both: --run-dir's old spelling)")
    collective_timeout_s: float | None = option(help=TIMEOUT_HELP + "; with --max-failures the group restarts from "
                                                "the last checkpoint", minimum=1, aliases=["--backend-timeout-s"])
    num_workers: str = option("2", "N, or MIN-MAX for an elastic run")
    use_gpu: str = option("auto", "auto: GPUs if the cluster has any", choices=["auto", "true", "false"],
                          convert=lambda v: str(v).lower())  # YAML's true too
    cpus_per_worker: float | None = option(
        help="CPUs (and torch threads) per worker, or auto (default): on a local Ray started by this command, the "
             "machine's cores divided among the workers; on a cluster, a node's CPUs divided among the workers it "
             "would host (GPU runs: its CPUs per GPU)", convert=parse_cpus)
    resources_per_worker: dict[str, float] = option(
        {}, "custom Ray resources each worker also needs, e.g. spot_slot=1 (one worker per node that offers one)",
        convert=parse_resources, metavar="NAME=N[,NAME=N]")
    storage_path: str = option("./runs", "the folder of run folders: a local path or pyarrow URI (s3://, gs://)")
    max_failures: int | None = option(
        help=f"worker-group restarts Ray Train may do (each lost node is one); default: 0 for a fixed number of workers, "
             f"{ELASTIC_MAX_FAILURES} for a MIN-MAX range (it resizes after up to {ELASTIC_MAX_FAILURES} failures)",
        minimum=0)
    elastic_check_seconds: float = option(60.0, "how often Ray checks to resize an elastic run", minimum=0)
    num_cpus: int | None = option(help="logical CPUs of a local Ray (default max(8, 2 x cores))", minimum=1)
    eval_tasks: str | None = option(help="a task list (docs/evaluation.md): every new checkpoint is scored on it by "
                                    "a Ray task beside training, into RUN/eval.jsonl and metrics.jsonl")
    eval_resources: dict[str, float] = option({"CPU": 1.0}, "Ray resources of each evaluation task, which training "
                                              "never waits for", convert=parse_eval_resources, metavar="CPU=N[,GPU=N]")
    eval_best: str | None = option(help="the score that picks the best checkpoint (RUN/best.json), as "
                                   "eval/<task>/<metric> (default: the first task's acc_norm, or its bpb)")
    eval_wait_minutes: float = option(10.0, "after the last step, how long to wait for the last checkpoint's scores",
                                      minimum=0)
    data_dir: str | None = None  # the data every worker opens: a local folder, or a remote URI it copies once
    storage_dir: str | None = None  # STORAGE/NAME, printable (no credentials): named in messages

    @property
    def workers(self) -> tuple[int, int]:
        return parse_num_workers(self.num_workers)

    @property
    def failures(self) -> int:
        """--max-failures, or its default: an elastic range may resize, a fixed size ends at its first failure."""
        if self.max_failures is not None:
            return self.max_failures
        low, high = self.workers
        return ELASTIC_MAX_FAILURES if low < high else 0


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), which Ray's logical CPUs may overstate."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def connect_failure(address: str, error: BaseException) -> str:
    """One line for a cluster that could not be joined (Ray raises ConnectionError from its own chain)."""
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    import ray.exceptions

    # Ray 2.60 puts the AuthenticationError into a RuntimeError's text ("Last connection error: ..."), not its chain
    if any(isinstance(x, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(x) for x in chain):
        why = ("it refused this process's authentication token (the cluster has token authentication on): set "
               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (or RAY_AUTH_TOKEN_PATH to its file)")
    else:
        why = f"nothing answered there; is the cluster up (`ray status --address {address}`)?"
    return f"cannot join the Ray cluster at RAY_ADDRESS={address}: {why}"


def ensure_ray(num_cpus: int | None = None) -> bool:
    """Join RAY_ADDRESS's cluster (ray job submit sets it) or start a local Ray; True when it started one. A local Ray
    gets more logical CPUs than cores: workers that take every CPU would starve the Ray Data tasks feeding them."""
    import ray
    import ray.exceptions

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=address, log_to_driver=True, logging_level="WARNING")
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise UsageError(connect_failure(address, e)) from None
        return False
    cores = os.cpu_count() or 2
    quiet_token_auth_notice()  # Ray says it turned token auth on: nothing for the user to do
    # address="local": a new Ray even when another one runs on this machine (join a cluster via RAY_ADDRESS).
    ray.init(address="local", num_cpus=num_cpus or max(8, 2 * cores), log_to_driver=True, include_dashboard=None,
             logging_level="WARNING")
    return True

