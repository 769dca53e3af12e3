"""The tracker backends, one class per kind, each importing its package only when it opens a run on rank 0."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import secrets
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .safety import redact

# The module each kind imports, and the package that provides it.
REQUIRED = {"tensorboard": ("tensorboardX", "tensorboardX"), "mlflow": ("mlflow", "mlflow-skinny"),
            "wandb": ("wandb", "wandb")}
# MLflow's SQL stores (the default is SQLite in the run folder) need two packages mlflow-skinny leaves out.
MLFLOW_SQL = (("sqlalchemy", "sqlalchemy"), ("alembic", "alembic"))


class TrackerError(ValueError):
    """A tracker cannot be used as asked; the message is one line that says what to do."""

    def __init__(self, message: str):
        super().__init__(redact(message))  # a tracking URI's password is in no message


def require_installed(kind: str, module: str, package: str, why: str | None = None, *, load: bool = False) -> Any:
    """Find `module` (driver) or, with `load`, import it (worker); a missing one: a TrackerError naming the extra."""
    try:
        if load:
            return importlib.import_module(module)
        if importlib.util.find_spec(module) is not None:
            return None
        error = ""
    except (ImportError, ValueError) as e:  # a broken install, or a module stubbed out with None
        if load and not isinstance(e, ImportError):
            raise
        error = f" ({e})" if load else ""
    raise TrackerError(f"--tracker {kind} needs the {package} package, which is not installed"
                       f"{' (' + why + ')' if why else ''}: pip install 'minilm[{kind}]' (or 'minilm[trackers]' for "
                       f"all three){error}")


def tensorboard_dir(run_dir: str | os.PathLike | None) -> Path:
    """The folder TensorBoard's event files go to: the run folder, which must be local."""
    if run_dir is None:
        raise TrackerError("--tracker tensorboard writes event files into the run folder, which needs a local "
                           "--run-dir (a path, not s3:// or gs://)")
    return Path(run_dir)


def mlflow_tracking_uri(options: Mapping[str, Any], run_dir: str | os.PathLike | None) -> str:
    """`--mlflow-uri` (a plain path ending in .db: a SQLite file there), or SQLite in the run folder (MLflow 3 refuses
    its old file store unless MLFLOW_ALLOW_FILE_STORE=true)."""
    uri = options.get("mlflow_uri")
    if not uri:
        if run_dir is None:
            raise TrackerError("--tracker mlflow with a remote --run-dir needs --mlflow-uri (the default "
                               "store is a SQLite file in the local run folder)")
        return "sqlite:///" + str(Path(run_dir).expanduser().resolve() / "mlflow.db")
    uri = str(uri)
    return "sqlite:///" + str(Path(uri).expanduser().resolve()) if "://" not in uri and uri.endswith(".db") else uri


def is_sql_uri(uri: str) -> bool:
    return uri.split(":", 1)[0].split("+", 1)[0] in ("sqlite", "postgresql", "mysql", "mssql")


def flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """Nested hyperparameters -> {"model.hidden_size": 256, "train.betas": "[0.9, 0.95]", ...}."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_hparams(value, name + "."))
        elif value is not None:
            out[name] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value, default=str)
    return out


class Backend:
    """One tracker run: `write(scalars, step)`, `state()` (its resume state), `describe()`, `close(outcome)`;
    steps at or below `high_water` are already in the tracker and not logged again."""

    kind = ""
    high_water = -1
    new_run = True  # False when an existing tracker run is continued

    def write_eval(self, scalars: dict[str, float], step: int) -> None:
        """Scores at an earlier step than the last written: TensorBoard and MLflow take any step."""
        self.write(scalars, step)


class TensorBoard(Backend):
    kind = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int, hparams: dict):
        tbx = require_installed("tensorboard", *REQUIRED["tensorboard"], load=True)
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
        if not self.new_run:
            return
        flat = flatten_hparams(hparams)
        # HParams dashboard: the values, and the metrics to show beside them (scalars of this run).
        experiment, session_start, _ = tbx.summary.hparams(flat, {"loss": None, "val_loss": None})
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


@contextlib.contextmanager
def short_requests(uri: str):
    """MLflow's HTTP requests, while logging a step, time out in 5 s without retries (unless the user set those): a
    server that went away costs a step one short try (Trackers tries it once a minute), not minutes of retries."""
    bounds = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    added = {k: v for k, v in bounds.items() if k not in os.environ} if uri.startswith(("http:", "https:")) else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


class MLflow(Backend):
    kind = "mlflow"
    STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}

    def __init__(self, uri: str, saved: dict | None, run_name: str, hparams: dict, opts: dict,
                 run_dir: Path | None, say: Callable[[str], None]):
        for module, package in (REQUIRED["mlflow"], *(MLFLOW_SQL if is_sql_uri(uri) else ())):
            require_installed("mlflow", module, package, load=True)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = uri
        try:
            with warnings.catch_warnings():  # SQLAlchemy deprecation notes from MLflow's store: not ours
                warnings.simplefilter("ignore", DeprecationWarning)
                self.client = MlflowClient(tracking_uri=uri)
                continued = self._continue(saved, say) if saved and saved.get("run_id") else None
                self.run_id = continued or self._create(run_name, hparams, opts, run_dir)
        except MlflowException as e:
            raise TrackerError(f"--tracker mlflow: cannot use the tracking store {uri}: "
                               f"{str(e.message).splitlines()[0]}") from None

    def _continue(self, saved: dict, say: Callable[[str], None]) -> str | None:
        from mlflow.exceptions import MlflowException

        run_id = saved["run_id"]
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            say(f"mlflow: run {run_id} of the checkpoint is not in {redact(self.uri)}; starting a new MLflow run")
            return None
        if run.info.lifecycle_stage != "active":
            say(f"mlflow: run {run_id} of the checkpoint was deleted; starting a new MLflow run")
            return None
        self.client.update_run(run_id, status="RUNNING")
        self.new_run = False
        # The last step held: what this run logged before a crash can be past the checkpoint's step.
        steps = [int(p.step) for key in run.data.metrics for p in self.client.get_metric_history(run_id, key)]
        self.high_water = max([self.high_water, *steps])
        return run_id

    def _create(self, run_name: str, hparams: dict, opts: dict, run_dir: Path | None) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        name = opts["mlflow_experiment"]
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            # Artifacts (none are logged today) would otherwise go to ./mlruns of the worker's cwd.
            location = (run_dir / "mlartifacts").resolve().as_uri() if run_dir is not None else None
            with contextlib.suppress(MlflowException):  # another trial of a sweep created it first
                self.client.create_experiment(name, artifact_location=location)
            experiment = self.client.get_experiment_by_name(name)
        optional = {"minilm.group": opts.get("group"), "mlflow.source.git.commit": hparams.get("git_commit")}
        tags = {"minilm.run_name": run_name, **{k: str(v) for k, v in optional.items() if v}}
        run_id = self.client.create_run(experiment.experiment_id, run_name=run_name, tags=tags).info.run_id
        params = [Param(k, str(v)[:500]) for k, v in flatten_hparams(hparams).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def write(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        with short_requests(self.uri):
            for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def state(self) -> dict[str, Any]:
        # state.json and trackers.json keep the URI without its password: a resume gets it from its flag again
        state = {"run_id": self.run_id, "tracking_uri": redact(self.uri)}
        if state["tracking_uri"] != self.uri:
            state["tracking_uri_redacted"] = True
        return state

    def describe(self) -> str:
        return f"mlflow run {self.run_id} in {redact(self.uri)}"

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS.get(outcome, "FINISHED"))


class Wandb(Backend):
    kind = "wandb"

    def __init__(self, saved: dict | None, run_name: str, hparams: dict, opts: dict, run_dir: Path | None):
        wandb = require_installed("wandb", *REQUIRED["wandb"], load=True)
        resuming = bool(saved and saved.get("run_id"))
        slug = re.sub(r"[^a-z0-9_-]+", "-", run_name.lower()).strip("-")[:48] or "run"  # W&B ids avoid / \ # ? % :
        self.run_id = saved["run_id"] if resuming else f"{slug}-{secrets.token_hex(4)}"  # readable and unique
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

    def write_eval(self, scalars: dict[str, float], step: int) -> None:
        # W&B drops a step below its current one: scores get their own x axis, eval/step (W&B's define_metric)
        if not getattr(self, "_eval_axis", False):
            self.run.define_metric("eval/step")
            self.run.define_metric("eval/*", step_metric="eval/step")
            self._eval_axis = True
        self.run.log({**scalars, "eval/step": step}, step=max(step, self.high_water))  # W&B's own axis never goes back

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "project": self.project}

    def describe(self) -> str:
        mode = getattr(self.run.settings, "mode", "")
        return f"wandb run {self.run_id} in project {self.project}" + (f" ({mode})" if mode else "")

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == "finished" else 1)
