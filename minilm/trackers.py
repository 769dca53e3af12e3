"""Experiment trackers (TensorBoard, MLflow, W&B) that survive resume: each one's run id is saved in the checkpoint,
and steps redone after a crash never make a step axis go backwards (docs/tracking.md)."""

from __future__ import annotations

import contextlib
import json
import netrc
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import tracker_backends
from .fsio import write_atomic
from .safety import redact
from .tracker_backends import Backend, TrackerError, mlflow_tracking_uri, tensorboard_dir

KINDS = ("tensorboard", "mlflow", "wandb")
SIDECAR = "trackers.json"  # in the run folder: run ids and the last step each tracker holds
STATE_VERSION = 1

DEFAULT_OPTIONS = {
    "mlflow_uri": None,  # default: sqlite:///RUN_DIR/mlflow.db
    "mlflow_experiment": "minilm",
    "wandb_project": "minilm",
    "wandb_entity": None,
    "group": None,  # a sweep's name: W&B group, MLflow tag minilm.group
}

# Names for the levels of nested list metrics: expert_load[layer][expert] -> expert_load/layer0/expert1.
LIST_LEVELS = {"expert_load": ("layer", "expert")}


# ---- checks before any work ---------------------------------------------------------------------

def parse_kinds(kinds: str | Iterable[str] | None) -> list[str]:
    """`--tracker` values (each may be comma-separated) -> tracker kinds, in order, without repeats."""
    if kinds is None:
        return []
    if isinstance(kinds, str) or not isinstance(kinds, Iterable):  # a YAML `tracker: 1.5` is one value too
        kinds = [kinds]
    names = [part.strip().lower() for value in kinds for part in str(value).split(",") if part.strip()]
    unknown = [n for n in names if n not in (*KINDS, "none")]
    if unknown:
        raise TrackerError(f"--tracker {unknown[0]}: unknown tracker; choose from none, {', '.join(KINDS)}")
    if "none" in names and len(set(names)) > 1:
        raise TrackerError("--tracker none cannot be combined with other trackers")
    return [] if "none" in names else list(dict.fromkeys(names))


def check_trackers(kinds: str | Iterable[str] | None, options: Mapping[str, Any] | None = None, *,
                   run_dir: str | os.PathLike | None = None) -> list[str]:
    """Check tracker names, packages and options before any work (`run_dir` None: remote storage); the kinds."""
    names = parse_kinds(kinds)
    for kind in names:
        tracker_backends.require_installed(kind, *tracker_backends.REQUIRED[kind])
    if "tensorboard" in names:
        tensorboard_dir(run_dir)
    if "mlflow" in names:
        uri = mlflow_tracking_uri(options or {}, run_dir)
        if tracker_backends.is_sql_uri(uri):
            for module, package in tracker_backends.MLFLOW_SQL:
                why = f"MLflow's SQL store ({uri.split(':', 1)[0]}) needs {package}"
                tracker_backends.require_installed("mlflow", module, package, why=why)
        _check_reachable(uri)
    if "wandb" in names:
        _check_wandb_credentials()
    return names


REACH_TIMEOUT_S = 5.0


def _check_reachable(uri: str) -> None:
    """An MLflow server (http, https) that does not answer an HTTP request within REACH_TIMEOUT_S (nothing listens,
    or it accepts and never answers) is refused in seconds: MLflow's own retries would hold the start for minutes."""
    import http.client
    import ssl

    parts = urlparse(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise TrackerError(f"--mlflow-uri {redact(uri)}: its port is not a number") from None
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, port, timeout=REACH_TIMEOUT_S)
    try:
        with contextlib.closing(conn):
            conn.request("GET", parts.path.rstrip("/") + "/health")
            conn.getresponse()  # any answer will do: MLflow says itself what else is wrong
    except ssl.SSLError:
        pass  # something answers (its certificate is MLflow's business, and its message)
    except (OSError, http.client.HTTPException) as e:
        raise TrackerError(f"--mlflow-uri {redact(uri)}: nothing answers at {parts.hostname}:{port} within "
                           f"{REACH_TIMEOUT_S:g} s ({getattr(e, 'strerror', None) or type(e).__name__}): start the "
                           f"MLflow server, or leave --mlflow-uri out for a SQLite file in the run folder") from None


def _check_wandb_credentials() -> None:
    """Online W&B needs an API key; without one wandb.init would stop on a login prompt in a worker."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun", "disabled") \
            or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    with contextlib.suppress(netrc.NetrcParseError, OSError):  # no .netrc, or a broken one
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    raise TrackerError("--tracker wandb: no W&B API key (run `wandb login`, or set WANDB_API_KEY on every node, "
                       "or WANDB_MODE=offline to log locally and `wandb sync` later)")


# ---- what gets logged ---------------------------------------------------------------------------

def flatten_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Reported metrics -> {name: float}. Lists become one scalar per element, named by level
    (expert_load -> expert_load/layer0/expert1); dicts become name/key; strings and None are dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        _flatten_into(out, str(key), value, LIST_LEVELS.get(str(key), ()))
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
                code_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """The hyperparameters logged once per tracker run: configs, world size, data, code version."""
    hparams = {"model": dict(model_config), "train": dict(train_config), "world_size": world_size,
               "data_fingerprint": data_fingerprint, "tokenizer_sha256": tokenizer_sha256, **code_version(code_dir)}
    return {k: v for k, v in hparams.items() if v is not None and v != ""}


def code_version(code_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"git_commit": ..., "git_dirty": ...} of the code, or {} when it is not a git checkout. A Ray job's working dir
    is a copy without .git: MINILM_GIT_COMMIT (forwarded to the workers) names the commit there."""
    if os.environ.get("MINILM_GIT_COMMIT"):
        return {"git_commit": os.environ["MINILM_GIT_COMMIT"]}
    root = Path(code_dir) if code_dir else Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # not some unrelated repository that happens to enclose an install
        return {}
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": bool(dirty)} if commit else {}


RETRY_S = 60.0  # a tracker that failed is tried again this often (a try costs at most one request's timeout)
BACKLOG = 10_000  # what is kept for a tracker that is away, written when it answers again


class Trackers:
    """The trackers of one run on rank 0 (empty: every call a no-op). A tracker that fails is away: one warning, then
    what it misses is kept (up to BACKLOG writes) and it is tried again every RETRY_S s; when it answers, it is caught
    up, and a gap past BACKLOG is said. Training never waits for it (metrics.jsonl has every step)."""

    def __init__(self, backends: list[Backend], *, sidecar: Path | None = None,
                 carried: dict[str, Any] | None = None, say: Callable[[str], None] = print):
        self.backends, self.sidecar, self.say = backends, sidecar, say
        self.carried = carried or {}  # state of trackers not opened this time, kept for a later resume
        self._away: dict[str, dict] = {}  # kind -> {"queue": [(eval?, scalars, step)], "retry_at", "lost": [steps]}

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one reported step (a step at or below a tracker's high water, redone after a crash, is not)."""
        if not self.backends:  # a run without trackers: nothing to flatten
            return
        scalars = flatten_metrics(metrics)
        before = [b.high_water for b in self.backends]
        for backend in self.backends:
            queued = self._away.get(backend.kind, {}).get("queue", [])
            if step > backend.high_water and not any(s == step for is_eval, _, s in queued if not is_eval):
                self._deliver(backend, (False, scalars, step))
        if before != [b.high_water for b in self.backends]:
            self._write_sidecar()

    def log_eval(self, metrics: Mapping[str, float], step: int) -> None:
        """Scores of the checkpoint at `step`, arriving after later steps were logged (evaluated beside training):
        each tracker writes them at that step on a step axis of their own where it needs one (W&B)."""
        for backend in self.backends:
            self._deliver(backend, (True, dict(metrics), step))

    def _deliver(self, backend: Backend, item: tuple) -> None:
        """Write `item` after what the tracker missed; while it is away (until its next try), only keep it."""
        away = self._away.get(backend.kind)
        if away is not None:
            away["queue"].append(item)
            if len(away["queue"]) > BACKLOG:
                away["lost"].append(away["queue"].pop(0)[2])
            if time.monotonic() < away["retry_at"]:
                return
        try:
            for is_eval, scalars, step in list(away["queue"]) if away else [item]:
                (backend.write_eval if is_eval else backend.write)(scalars, step)
                backend.high_water = backend.high_water if is_eval else step
                if away:
                    away["queue"].pop(0)
        except Exception as e:  # a tracker server that is down or hangs must never stop a long training run
            if away is None:
                what = f"the scores of step {item[2]}" if item[0] else f"step {item[2]}"
                self.say(redact(f"warning: {backend.kind} could not log {what}: {type(e).__name__}: {e}; training "
                                f"goes on (metrics.jsonl has every step), and {backend.kind} is tried again every "
                                f"{RETRY_S:g} s, then caught up"))
                away = self._away[backend.kind] = {"queue": [item], "lost": []}
            away["retry_at"] = time.monotonic() + RETRY_S
            return
        if away is not None:
            del self._away[backend.kind]
            self._write_sidecar()
            lost = away["lost"]
            self.say(f"note: {backend.kind} answers again: caught up what it missed" + (
                f"; {len(lost)} write(s) of steps {min(lost)}-{max(lost)} are not in it (metrics.jsonl has them)"
                if lost else ""))

    def state_dict(self) -> dict[str, Any]:
        """JSON-able resume state for state.json: each tracker's run id (and of trackers not open now)."""
        return {"version": STATE_VERSION, **self.carried, **{b.kind: b.state() for b in self.backends}}

    def close(self, outcome: str = "finished") -> None:
        """End the tracker runs: outcome "finished", "failed" (an error) or "killed" (preempted); a tracker that is
        away is tried once more, and what it still misses is said."""
        for backend in self.backends:
            away = self._away.get(backend.kind)
            if away is not None:
                away["retry_at"] = 0.0
                self._deliver(backend, away["queue"].pop())
                if backend.kind in self._away:
                    steps = [s for _, _, s in self._away.pop(backend.kind)["queue"]] + away["lost"]
                    self.say(f"note: {backend.kind} is still away at the end: {len(steps)} write(s) of steps "
                             f"{min(steps)}-{max(steps)} are not in it (metrics.jsonl has them)")
            try:
                backend.close(outcome)
            except Exception as e:
                self.say(redact(f"warning: closing {backend.kind} failed: {type(e).__name__}: {e}"))
        self.backends = []

    def _write_sidecar(self) -> None:
        if self.sidecar is None:
            return
        entries = {b.kind: {**b.state(), "last_step": b.high_water} for b in self.backends}
        # whole or not at all, even if the worker is killed mid-write
        write_atomic(self.sidecar, json.dumps({"version": STATE_VERSION, "trackers": entries}, indent=1, sort_keys=True))


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
    """Open (or continue, with `resume_state`: the checkpoint's `Trackers.state_dict()`) each tracker's run for the run
    in `run_dir`, starting after `start_step`; a TrackerError closes the trackers already opened."""
    names = parse_kinds(kinds)
    opts = {**DEFAULT_OPTIONS, **{k: v for k, v in (options or {}).items() if v is not None}}
    run_path = Path(run_dir).expanduser() if run_dir is not None else None
    sidecar = run_path / SIDECAR if run_path is not None else None
    saved = {k: v for k, v in (resume_state or {}).items() if k in KINDS and isinstance(v, dict)}
    hp = dict(hparams or {})
    backends: list[Backend] = []
    try:
        for kind in names:
            if kind == "tensorboard":
                backend = tracker_backends.TensorBoard(tensorboard_dir(run_path), start_step, hp)
            elif kind == "mlflow":
                backend = tracker_backends.MLflow(mlflow_tracking_uri(opts, run_path), saved.get("mlflow"), run_name, hp,
                                                  opts, run_path, say)
            else:
                backend = tracker_backends.Wandb(saved.get("wandb"), run_name, hp, opts, run_path)
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

