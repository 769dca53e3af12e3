"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) that survive resume.

Rank 0 opens the trackers once per (re)start of the worker group, logs every reported metric at its
optimizer step, and saves `Trackers.state_dict()` (each tracker's run id) in the checkpoint's
state.json. A resumed run, at any world size and from any job submission, passes that state back
to `open_trackers` and continues the same tracker run.

Steps redone after a crash (logged after the last checkpoint, then recomputed from it) never make
a tracker's step axis go backwards:

* TensorBoard overwrites them: the writer opens with `purge_step = first step to be redone`, and
  TensorBoard hides every older event at or past it (a `SessionLog.START` purge; the Rust data
  server also drops points a later record at a smaller step preempts).
* MLflow and W&B cannot delete points, so they keep a high-water mark: a step at or below the last
  step the tracker already holds is not logged again. The mark is read back from the tracker
  (MLflow's metric history, W&B's `starting_step` of a resumed online run) and from
  `trackers.json` in the run folder (rewritten after every log, so it survives a crash that
  no checkpoint saw). The points kept are the first attempt's; resume is exact, so loss, lr and
  grad norm are equal (bitwise at the same world size), only timings and world size may differ.

See docs/tracking.md. Nothing here imports a tracker package until a tracker of that kind is
opened, and nothing imports Ray.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import netrc
import os
import re
import secrets
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

KINDS = ("tensorboard", "mlflow", "wandb")
SIDECAR = "trackers.json"  # in the run folder: run ids and the last step each tracker holds
STATE_VERSION = 1

# What `import` each kind needs, as (module, the package that provides it).
REQUIRED = {
    "tensorboard": (("tensorboardX", "tensorboardX"),),
    "mlflow": (("mlflow", "mlflow-skinny"),),
    "wandb": (("wandb", "wandb"),),
}
# MLflow's SQL stores (the default, a SQLite file in the run folder) need two more packages that
# mlflow-skinny leaves out.
MLFLOW_SQL = (("sqlalchemy", "sqlalchemy"), ("alembic", "alembic"))

DEFAULT_OPTIONS = {
    "mlflow_uri": None,  # default: sqlite:///RUN_DIR/mlflow.db
    "mlflow_experiment": "minilm",
    "wandb_project": "minilm",
    "wandb_entity": None,
    "group": None,  # a sweep's name: W&B group, MLflow tag minilm.group
}

# Names for the levels of nested list metrics: expert_load[layer][expert] -> expert_load/layer0/expert1.
LIST_LEVELS = {"expert_load": ("layer", "expert")}


class TrackerError(ValueError):
    """A tracker cannot be used as asked; the message is one line that says what to do."""


# ---- checks before any work ---------------------------------------------------------------------

def parse_kinds(kinds: str | Iterable[str] | None) -> list[str]:
    """`--tracker` values -> tracker kinds, in order, without repeats.

    Accepts a list of flag values, each of which may be comma-separated ("tensorboard,mlflow");
    "none" (alone) or nothing means no tracker.
    """
    if kinds is None:
        return []
    if isinstance(kinds, str):
        kinds = [kinds]
    names = [part.strip().lower() for value in kinds for part in str(value).split(",") if part.strip()]
    unknown = [n for n in names if n not in (*KINDS, "none")]
    if unknown:
        raise TrackerError(f"--tracker {unknown[0]}: unknown tracker; choose from none, {', '.join(KINDS)}")
    if "none" in names:
        if len(set(names)) > 1:
            raise TrackerError("--tracker none cannot be combined with other trackers")
        return []
    return list(dict.fromkeys(names))


def check_trackers(kinds: str | Iterable[str] | None, options: Mapping[str, Any] | None = None, *,
                   run_dir: str | os.PathLike | None = None) -> list[str]:
    """Validate tracker names, their packages and options before any work; return the kinds.

    Call it in the driver (where a `TrackerError` becomes one `error:` line). `run_dir` is the
    local run folder, or None when checkpoints go to remote storage. Imports nothing heavy: a
    package is only looked up.
    """
    names = parse_kinds(kinds)
    opts = {**DEFAULT_OPTIONS, **(options or {})}
    for kind in names:
        for module, package in REQUIRED[kind]:
            _require_installed(kind, module, package)
    if "tensorboard" in names and run_dir is None:
        raise TrackerError("--tracker tensorboard writes event files into the run folder, which needs a local "
                           "--storage-path (a path, not s3:// or gs://)")
    if "mlflow" in names:
        uri = mlflow_tracking_uri(opts, run_dir)
        if _is_sql_uri(uri):
            for module, package in MLFLOW_SQL:
                _require_installed("mlflow", module, package,
                                   why=f"MLflow's SQL store ({uri.split(':', 1)[0]}) needs {package}")
    if "wandb" in names:
        _check_wandb_credentials()
    return names


def _require_installed(kind: str, module: str, package: str, why: str | None = None) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module stubbed out with None
        found = False
    if not found:
        raise TrackerError(_missing_message(kind, package, why))


def _import(kind: str, module: str, package: str):
    """Import a tracker package in the worker, with the same one-line message when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(_missing_message(kind, package, None) + f" ({e})") from None


def _missing_message(kind: str, package: str, why: str | None) -> str:
    return (f"--tracker {kind} needs the {package} package, which is not installed"
            f"{' (' + why + ')' if why else ''}: pip install 'minilm[{kind}]' (or 'minilm[trackers]' for all three)")


def _check_wandb_credentials() -> None:
    """Online W&B needs an API key; without one wandb.init would stop on a login prompt in a worker."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY") \
            or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise TrackerError("--tracker wandb: no W&B API key (run `wandb login`, or set WANDB_API_KEY on every node, "
                       "or WANDB_MODE=offline to log locally and `wandb sync` later)")


def mlflow_tracking_uri(options: Mapping[str, Any], run_dir: str | os.PathLike | None) -> str:
    """`--mlflow-uri`, or a SQLite file in the run folder.

    MLflow 3 refuses its old file store unless MLFLOW_ALLOW_FILE_STORE=true, so the local default
    is SQLite. A plain path ending in .db means a SQLite file there.
    """
    uri = options.get("mlflow_uri")
    if not uri:
        if run_dir is None:
            raise TrackerError("--tracker mlflow with a remote --storage-path needs --mlflow-uri (the default "
                               "store is a SQLite file in the local run folder)")
        return "sqlite:///" + str(Path(run_dir).expanduser().resolve() / "mlflow.db")
    uri = str(uri)
    if "://" not in uri and uri.endswith(".db"):
        return "sqlite:///" + str(Path(uri).expanduser().resolve())
    return uri


def _is_sql_uri(uri: str) -> bool:
    return uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")


# ---- what gets logged ---------------------------------------------------------------------------

def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Reported metrics -> {name: float}. Lists become one scalar per element, named by level
    (expert_load -> expert_load/layer0/expert1); dicts become name/key; strings and None are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        _flatten_into(out, f"{prefix}{key}", value, LIST_LEVELS.get(str(key), ()))
    return out


def _flatten_into(out: dict[str, float], name: str, value: Any, levels: tuple[str, ...]) -> None:
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays and scalars, torch tensors
    if isinstance(value, (bool, int, float)):
        out[name] = float(value)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten_into(out, f"{name}/{k}", v, ())
    elif isinstance(value, (list, tuple)):
        label, rest = (levels[0], levels[1:]) if levels else ("", ())
        for i, v in enumerate(value):
            _flatten_into(out, f"{name}/{label}{i}", v, rest)


def run_hparams(model_config: Mapping[str, Any], train_config: Mapping[str, Any], *, world_size: int,
                data_fingerprint: str | None = None, tokenizer_sha256: str | None = None,
                code_dir: str | os.PathLike | None = None, **extra: Any) -> dict[str, Any]:
    """The hyperparameters logged once per tracker run: configs, world size, data, code version."""
    hparams: dict[str, Any] = {"model": dict(model_config), "train": dict(train_config), "world_size": world_size}
    if data_fingerprint:
        hparams["data_fingerprint"] = data_fingerprint
    if tokenizer_sha256:
        hparams["tokenizer_sha256"] = tokenizer_sha256
    hparams.update(code_version(code_dir))
    hparams.update({k: v for k, v in extra.items() if v is not None})
    return hparams


def code_version(code_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"git_commit": ..., "git_dirty": ...} of the code, or {} when it is not a git checkout.

    A Ray job's working dir is a copy without .git; MINILM_GIT_COMMIT (forwarded to the workers
    like every MINILM_* variable) names the commit there.
    """
    if os.environ.get("MINILM_GIT_COMMIT"):
        return {"git_commit": os.environ["MINILM_GIT_COMMIT"]}
    root = Path(code_dir) if code_dir else Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # not some unrelated repository that happens to enclose an install
        return {}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": bool(dirty)} if commit else {}


def flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested hyperparameters -> {"model.hidden_size": 256, "train.betas": "[0.9, 0.95]", ...}."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_hparams(value, name + "."))
        elif value is None:
            continue
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


# ---- the trackers -------------------------------------------------------------------------------

class _Backend:
    """One tracker run. `high_water`: steps at or below it are already in the tracker and not logged."""

    kind = ""
    high_water = -1
    new_run = True  # False when an existing tracker run is continued

    def write(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def close(self, outcome: str) -> None:
        raise NotImplementedError


class _TensorBoard(_Backend):
    kind = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int, hparams: dict):
        tbx = _import("tensorboard", "tensorboardX", "tensorboardX")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = run_dir
        self.new_run = start_step == 0 or not any(run_dir.glob("*tfevents*"))
        # Everything after the step this run starts from is rewritten: purge from the first redone step
        # (0 on a fresh start: whatever an earlier attempt that never checkpointed wrote goes too).
        purge_step = start_step + 1 if start_step > 0 else 0
        # Event files are read in name order; ns in the name keeps two opens in one second in order.
        self.writer = tbx.SummaryWriter(logdir=str(run_dir), purge_step=purge_step, flush_secs=30,
                                        filename_suffix=f".{time.time_ns()}")
        self.high_water = start_step
        if self.new_run:
            self._write_hparams(hparams)

    def _write_hparams(self, hparams: dict) -> None:
        from tensorboardX.summary import hparams as hparams_summary

        flat = flatten_hparams(hparams)
        # HParams dashboard: the values, and the metrics to show beside them (scalars of this run).
        experiment, session_start, _ = hparams_summary(flat, {"loss": None, "val_loss": None})
        self.writer.file_writer.add_summary(experiment)
        self.writer.file_writer.add_summary(session_start)
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(flat.items()))
        self.writer.add_text("hparams", "| name | value |\n|---|---|\n" + table, global_step=0)
        self.writer.flush()

    def write(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a killed worker loses nothing already logged

    def state(self) -> dict[str, Any]:
        return {"log_dir": str(self.log_dir)}

    def describe(self) -> str:
        return f"tensorboard {self.log_dir} (tensorboard --logdir {self.log_dir})"

    def close(self, outcome: str) -> None:
        self.writer.close()


class _MLflow(_Backend):
    kind = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}

    def __init__(self, uri: str, saved: dict | None, run_name: str, hparams: dict, opts: dict,
                 run_dir: Path | None, say: Callable[[str], None]):
        _import("mlflow", "mlflow", "mlflow-skinny")
        if _is_sql_uri(uri):
            for module, package in MLFLOW_SQL:
                _import("mlflow", module, package)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = uri
        try:
            with warnings.catch_warnings():  # SQLAlchemy deprecation notes from MLflow's store: not ours
                warnings.simplefilter("ignore", DeprecationWarning)
                self.client = MlflowClient(tracking_uri=uri)
                self.run_id = self._continue(saved, say) if saved and saved.get("run_id") else None
                if self.run_id is None:
                    self.run_id = self._create(run_name, hparams, opts, run_dir)
        except MlflowException as e:
            raise TrackerError(f"--tracker mlflow: cannot use the tracking store {uri}: "
                               f"{str(e.message).splitlines()[0]}") from None

    def _continue(self, saved: dict, say: Callable[[str], None]) -> str | None:
        from mlflow.exceptions import MlflowException

        run_id = saved["run_id"]
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            say(f"mlflow: run {run_id} of the checkpoint is not in {self.uri}; starting a new MLflow run")
            return None
        if run.info.lifecycle_stage != "active":
            say(f"mlflow: run {run_id} of the checkpoint was deleted; starting a new MLflow run")
            return None
        self.client.update_run(run_id, status="RUNNING")
        self.new_run = False
        # The last step held: what this run logged before a crash can be past the checkpoint's step.
        for key in run.data.metrics:
            for point in self.client.get_metric_history(run_id, key):
                self.high_water = max(self.high_water, int(point.step))
        return run_id

    def _create(self, run_name: str, hparams: dict, opts: dict, run_dir: Path | None) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        name = opts["mlflow_experiment"]
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            # Artifacts (none are logged today) would otherwise go to ./mlruns of the worker's cwd.
            location = (run_dir / "mlartifacts").resolve().as_uri() if run_dir is not None else None
            try:
                experiment_id = self.client.create_experiment(name, artifact_location=location)
            except MlflowException:  # another trial of a sweep created it first
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        tags = {"minilm.run_name": run_name}
        if opts.get("group"):
            tags["minilm.group"] = str(opts["group"])
        code = hparams.get("git_commit")
        if code:
            tags["mlflow.source.git.commit"] = str(code)
        run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten_hparams(hparams).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def write(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def describe(self) -> str:
        return f"mlflow run {self.run_id} in {self.uri}"

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS.get(outcome, "FINISHED"))


class _Wandb(_Backend):
    kind = "wandb"

    def __init__(self, saved: dict | None, run_name: str, hparams: dict, opts: dict, run_dir: Path | None):
        wandb = _import("wandb", "wandb", "wandb")
        resuming = bool(saved and saved.get("run_id"))
        self.run_id = saved["run_id"] if resuming else _wandb_run_id(run_name)
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=opts["wandb_project"], entity=opts.get("wandb_entity"), group=opts.get("group"),
                name=run_name, id=self.run_id, resume="allow", dir=str(run_dir) if run_dir is not None else None,
                config=None if resuming else hparams,  # once per run; a resumed run keeps its config
                reinit="create_new",  # never hand back (or finish) a run the caller's own code has open
                # console off: W&B's stdout capture would fight Ray's log streaming in a worker
                settings=wandb.Settings(console="off", quiet=True))
        except Exception as e:  # wandb raises its own UsageError/CommError types
            raise TrackerError(f"--tracker wandb: wandb.init failed: {str(e).splitlines()[0] if str(e) else e!r}") \
                from None
        self.project = opts["wandb_project"]
        self.new_run = not resuming
        # Online, a resumed run starts after the last step the server holds; offline it cannot know
        # (starting_step 0), and the run folder's trackers.json says instead.
        if getattr(self.run, "starting_step", 0):
            self.high_water = int(self.run.starting_step) - 1

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "project": self.project}

    def describe(self) -> str:
        mode = getattr(self.run.settings, "mode", "")
        return f"wandb run {self.run_id} in project {self.project}" + (f" ({mode})" if mode else "")

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == "finished" else 1)


def _wandb_run_id(run_name: str) -> str:
    """A readable, unique W&B run id (W&B ids must avoid / \\ # ? % :)."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", run_name.lower()).strip("-")[:48] or "run"
    return f"{slug}-{secrets.token_hex(4)}"


class Trackers:
    """The trackers of one run on rank 0. Empty (every call a no-op) when no tracker was asked for."""

    def __init__(self, backends: list[_Backend], *, sidecar: Path | None = None,
                 carried: dict[str, Any] | None = None, say: Callable[[str], None] = print):
        self.backends = backends
        self.sidecar = sidecar
        self.carried = carried or {}  # state of trackers not opened this time, kept for a later resume
        self.say = say
        self._failures: dict[str, int] = {}

    @property
    def kinds(self) -> list[str]:
        return [b.kind for b in self.backends]

    def __bool__(self) -> bool:
        return bool(self.backends)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one reported step. A tracker error is reported and training goes on."""
        if not self.backends:
            return
        scalars = flatten_metrics(metrics)
        advanced = False
        for backend in self.backends:
            if step <= backend.high_water:
                continue  # already in this tracker (a step redone after a crash): never append it again
            try:
                backend.write(scalars, step)
            except Exception as e:  # a tracker server hiccup must not stop a long training run
                n = self._failures[backend.kind] = self._failures.get(backend.kind, 0) + 1
                if n == 1 or n % 50 == 0:
                    self.say(f"warning: {backend.kind} could not log step {step} ({n} failure(s) so far): "
                             f"{type(e).__name__}: {e}")
                continue
            backend.high_water = step
            advanced = True
        if advanced:
            self._write_sidecar()

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state for state.json: each tracker's run id (and of trackers not open now)."""
        state: dict[str, Any] = {"version": STATE_VERSION, **self.carried}
        for backend in self.backends:
            state[backend.kind] = backend.state()
        return state

    def describe(self) -> str:
        return "; ".join(b.describe() for b in self.backends)

    def close(self, outcome: str = "finished") -> None:
        """End the tracker runs: outcome "finished", "failed" (an error) or "killed" (preempted)."""
        for backend in self.backends:
            try:
                backend.close(outcome)
            except Exception as e:
                self.say(f"warning: closing {backend.kind} failed: {type(e).__name__}: {e}")
        self.backends = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("finished" if exc_type is None else "failed")

    def _write_sidecar(self) -> None:
        if self.sidecar is None:
            return
        entries = {b.kind: {**b.state(), "last_step": b.high_water} for b in self.backends}
        tmp = self.sidecar.with_name(self.sidecar.name + ".tmp")
        tmp.write_text(json.dumps({"version": STATE_VERSION, "trackers": entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.sidecar)  # whole or not at all, even if the worker is killed mid-write


def _sidecar_last_step(path: Path | None, kind: str, state: dict[str, Any]) -> int:
    """The last step the sidecar says this very tracker run holds, else -1."""
    if path is None or not path.is_file():
        return -1
    try:
        entry = json.loads(path.read_text())["trackers"][kind]
    except (OSError, ValueError, KeyError, TypeError):
        return -1  # unreadable or another layout: the tracker's own readback still applies
    same_run = all(entry.get(k) == v for k, v in state.items() if k in ("run_id", "log_dir"))
    return int(entry.get("last_step", -1)) if same_run else -1


def open_trackers(kinds: str | Iterable[str] | None, *, run_dir: str | os.PathLike | None, run_name: str,
                  start_step: int = 0, resume_state: Mapping[str, Any] | None = None,
                  hparams: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                  say: Callable[[str], None] = print) -> Trackers:
    """Open (or continue) each tracker's run for the run in `run_dir`, starting after `start_step`.

    `resume_state` is what `Trackers.state_dict()` returned at the checkpoint being resumed (None on
    a fresh start); `hparams` (see `run_hparams`) is logged when a tracker run is created. Raises
    TrackerError with a one-line message when a tracker cannot be opened; closes the ones already
    opened first.
    """
    names = parse_kinds(kinds)
    opts = {**DEFAULT_OPTIONS, **{k: v for k, v in (options or {}).items() if v is not None}}
    run_path = Path(run_dir).expanduser() if run_dir is not None else None
    sidecar = run_path / SIDECAR if run_path is not None else None
    saved = {k: v for k, v in (resume_state or {}).items() if k in KINDS and isinstance(v, dict)}
    hp = dict(hparams or {})
    backends: list[_Backend] = []
    try:
        for kind in names:
            if kind == "tensorboard":
                if run_path is None:
                    raise TrackerError("--tracker tensorboard needs a local run folder (a local --storage-path)")
                backend: _Backend = _TensorBoard(run_path, start_step, hp)
            elif kind == "mlflow":
                backend = _MLflow(mlflow_tracking_uri(opts, run_path), saved.get("mlflow"), run_name, hp, opts,
                                  run_path, say)
            else:
                backend = _Wandb(saved.get("wandb"), run_name, hp, opts, run_path)
            if kind != "tensorboard":  # TensorBoard overwrites redone steps; the others must skip them
                backend.high_water = max(backend.high_water, _sidecar_last_step(sidecar, kind, backend.state()))
            if not backend.new_run and backend.high_water > start_step:
                say(f"{kind}: continuing {backend.describe()}; steps {start_step + 1}-{backend.high_water} "
                    f"were logged before the restart and are not logged again")
            backends.append(backend)
    except BaseException:
        Trackers(backends, say=say).close("failed")
        raise
    trackers = Trackers(backends, sidecar=sidecar, say=say,
                        carried={k: v for k, v in saved.items() if k not in names})
    if backends:
        trackers._write_sidecar()
    return trackers


__all__ = ["KINDS", "TrackerError", "Trackers", "check_trackers", "code_version", "flatten_hparams",
           "flatten_metrics", "mlflow_tracking_uri", "open_trackers", "parse_kinds", "run_hparams"]
