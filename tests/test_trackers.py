"""Experiment trackers across an interrupted and resumed run (minilm/trackers.py), no Ray.

The scenario mimics rank 0 of ray_jobs/worker.py: every reported step goes to metrics.jsonl
(MetricsLog) and to the trackers; the checkpoint at step 8 stores `Trackers.state_dict()`; the
process dies after step 12 (SIGKILL, or an uncaught error); the resumed process truncates
metrics.jsonl after step 8, reopens the trackers from the saved state at another world size, and
redoes steps 12, 16, 20. Each tracker is then read back the way its own tools read it:
TensorBoard's EventAccumulator, MLflow's client on the SQLite store, and W&B's offline .wandb files.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from minilm import trackers as T
from minilm.progress import MetricsLog
from minilm.tracker_backends import Backend, flatten_hparams

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIRST_STEPS, CHECKPOINT_STEP, REDO_STEPS = (4, 8, 12), 8, (12, 16, 20)
# A fixed code version (code_dir: not a checkout; git_commit given): the subprocess's HPARAMS equal this process's
# even when a commit lands on the repository during the run (test_hparams_flatten_and_code_version reads git).
HPARAMS = {**T.run_hparams({"hidden_size": 64, "num_hidden_layers": 2, "use_moe": True},
                           {"lr": 1e-3, "betas": [0.9, 0.95], "global_batch_size": 32},
                           world_size=2, data_fingerprint="fp-123", tokenizer_sha256="tok-456", code_dir=TESTS),
           "git_commit": "0123456789abcdef0123456789abcdef01234567"}
OPTIONS = {"mlflow_experiment": "tests", "wandb_project": "minilm-tests"}


def reported(step: int, attempt: int) -> dict:
    """What worker.Meter.metrics reports at `step`. Resume is exact, so losses, lr and grad norm are
    the same in both attempts; timings differ, and the resumed attempt runs at world size 4."""
    world = 2 if attempt == 0 else 4
    metrics = {
        "loss": 10.0 / step, "lm_loss": 9.5 / step, "aux_loss": 0.5 / step, "lr": 1e-3 * min(1.0, step / 10),
        "grad_norm": 1.0 + step / 100, "tokens_per_s": 1000.0 + step + 500 * attempt, "mfu": 0.1 + 0.01 * attempt,
        "optimizer_step": step, "total_steps": 20, "samples_seen": 32 * step, "tokens_seen": 32 * 32 * step,
        "epoch": 0, "epochs": 1, "world_size": world, "accumulation_steps": 4 // world, "skipped_steps": 0,
        "data_wait_frac": 0.01 * (attempt + 1), "checkpoint_s": 0.25 * attempt, "eta_s": float(20 - step),
        "expert_load": [[0.25 + 0.01 * step, 0.75 - 0.01 * step], [0.5, 0.5]],
    }
    if step % 8 == 0:
        metrics["val_loss"] = 11.0 / step
    return metrics


def log_step(trackers: T.Trackers, metrics_log: MetricsLog, metrics: dict, step: int) -> None:
    # As worker.report on rank 0: the record (plus time and run id) to metrics.jsonl, the metrics to the trackers.
    metrics_log.append({**metrics, "time": time.time(), "run_id": "run1-1"})
    trackers.log(metrics, step=step)


def first_attempt(kinds: list[str], run_dir: str, crash: str) -> None:
    """Runs in a subprocess: steps 4, 8 (checkpoint), 12, then the process dies without closing anything."""
    run = Path(run_dir)
    trackers = T.open_trackers(kinds, run_dir=run, run_name="run1", hparams=HPARAMS, options=OPTIONS)
    metrics_log = MetricsLog(run / "metrics.jsonl")
    for step in FIRST_STEPS:
        log_step(trackers, metrics_log, reported(step, attempt=0), step)
        if step == CHECKPOINT_STEP:  # worker.checkpoint_state puts the trackers' state into state.json
            state = {"optimizer_step": step, "world_size": 2, "trackers": trackers.state_dict()}
            (run / "state.json").write_text(json.dumps(state))
    if crash == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # nothing is flushed or closed, no atexit handler runs
    raise RuntimeError("simulated crash after optimizer step 12")  # an error: atexit handlers still run


def interrupted_and_resumed(run_dir: Path, kinds: list[str], crash: str, env: dict) -> Path:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:3]; import test_trackers as t; "
                               "t.first_attempt(sys.argv[3].split(','), sys.argv[4], sys.argv[5])",
         str(TESTS), str(ROOT), ",".join(kinds), str(run_dir), crash],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    expected_rc = -signal.SIGKILL if crash == "kill" else 1
    assert proc.returncode == expected_rc, proc.stderr[-3000:]
    assert "simulated crash" in proc.stderr or crash == "kill", proc.stderr[-3000:]

    # The resumed process, as worker.setup on rank 0: restore state.json, drop the records to be redone.
    state = json.loads((run_dir / "state.json").read_text())
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    metrics_log.truncate_after(state["optimizer_step"])
    said: list[str] = []
    trackers = T.open_trackers(kinds, run_dir=run_dir, run_name="run1", start_step=state["optimizer_step"],
                               resume_state=state["trackers"], hparams={**HPARAMS, "world_size": 4}, options=OPTIONS,
                               say=said.append)
    assert trackers.state_dict() == state["trackers"]  # the same tracker runs, not new ones
    for step in REDO_STEPS:
        log_step(trackers, metrics_log, reported(step, attempt=1), step)
    trackers.close("finished")
    for kind in kinds:
        if kind != "tensorboard":
            assert any(line.startswith(f"{kind}: continuing") and "steps 9-12" in line for line in said), said
    return run_dir


@pytest.fixture(scope="module")
def tracker_env(tmp_path_factory):
    """W&B offline, with its config and cache in the test's temp dir rather than the home folder."""
    home = tmp_path_factory.mktemp("wandb-home")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data")}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield env


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, tracker_env):
    """TensorBoard and MLflow together; the first attempt is SIGKILLed after step 12."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    return interrupted_and_resumed(tmp_path_factory.mktemp("killed") / "run1", ["tensorboard", "mlflow"], "kill",
                                   tracker_env)


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory, tracker_env):
    """W&B offline; the first attempt dies of an uncaught error after step 12 (a SIGKILL would also lose
    what W&B's service process had not written yet: its own durability, see docs/tracking.md)."""
    pytest.importorskip("wandb")
    return interrupted_and_resumed(tmp_path_factory.mktemp("failed") / "run1", ["wandb"], "error", tracker_env)


# ---- what the trackers must hold -----------------------------------------------------------------

def jsonl_points(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl after the resumed run, as {step: {flattened metric: value}} (time and run id are not metrics)."""
    points = {}
    for rec in MetricsLog(run_dir / "metrics.jsonl").read():
        points[rec["optimizer_step"]] = T.flatten_metrics({k: v for k, v in rec.items() if k not in ("time", "run_id")})
    return points


def check_series(series: dict[str, list[tuple[int, float]]], expected: dict[int, dict[str, float]],
                 rel: float = 1e-12) -> None:
    """One series per metric, steps strictly increasing, and exactly the expected points."""
    names = {name for point in expected.values() for name in point}
    assert set(series) == names
    for name, points in series.items():
        steps = [s for s, _ in points]
        assert all(a < b for a, b in zip(steps, steps[1:], strict=False)), (name, steps)
        want = [(s, expected[s][name]) for s in sorted(expected) if name in expected[s]]
        assert steps == [s for s, _ in want], name
        assert [v for _, v in points] == pytest.approx([v for _, v in want], rel=rel), name


@pytest.mark.slow
def test_metrics_jsonl_holds_the_redone_steps(killed_run):
    points = jsonl_points(killed_run)
    assert sorted(points) == [4, 8, 12, 16, 20]
    assert points[12] == T.flatten_metrics(reported(12, attempt=1))
    assert points[8] == T.flatten_metrics(reported(8, attempt=0))


@pytest.mark.slow
def test_tensorboard_overwrites_redone_steps(killed_run):
    """TensorBoard: one run (the run folder); the redone step 12 replaces the first attempt's, so every
    point equals metrics.jsonl, read with TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert not [p for p in killed_run.rglob("*tfevents*") if p.parent != killed_run]  # one TensorBoard run
    acc = EventAccumulator(str(killed_run), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    check_series(series, jsonl_points(killed_run), rel=1e-6)  # event files hold float32
    assert "expert_load/layer0/expert1" in series and "val_loss" in series
    # Hyperparameters once per run: written by the first attempt only.
    texts = acc.Tensors("hparams/text_summary")
    assert [e.step for e in texts] == [0]
    text = texts[0].tensor_proto.string_val[0].decode()
    assert "| model.hidden_size | 64 |" in text and "| world_size | 2 |" in text and "| data_fingerprint | fp-123 |" in text
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")


@pytest.mark.slow
def test_mlflow_keeps_one_run_and_never_appends_a_redone_step(killed_run):
    """MLflow (SQLite store in the run folder): one run, continued; every point equals metrics.jsonl except
    the redone step 12, which keeps the first attempt's record (losses equal, timings differ)."""
    from mlflow.tracking import MlflowClient

    state = json.loads((killed_run / "state.json").read_text())["trackers"]["mlflow"]
    assert state["tracking_uri"] == f"sqlite:///{killed_run.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [state["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run1"
    series = {}
    for name in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, name), key=lambda m: m.timestamp)  # stable
        series[name] = [(m.step, m.value) for m in history]
    expected = jsonl_points(killed_run)
    expected[12] = T.flatten_metrics(reported(12, attempt=0))
    check_series(series, expected)
    assert expected[12]["loss"] == jsonl_points(killed_run)[12]["loss"]
    # Hyperparameters once, from the first attempt (world size 2), and the code version when known.
    assert run.data.params == {k: str(v) for k, v in flatten_hparams(HPARAMS).items()}
    assert run.data.tags["mlflow.source.git.commit"] == HPARAMS["git_commit"]


def test_mlflow_high_water_mark_without_a_run_folder(tmp_path):
    """Remote --storage-path: no run folder, no trackers.json; MLflow's own history gives the last step."""
    pytest.importorskip("mlflow")
    opts = {"mlflow_uri": str(tmp_path / "store" / "mlflow.db")}
    trackers = T.open_trackers(["mlflow"], run_dir=None, run_name="r", hparams=HPARAMS, options=opts)
    for step in FIRST_STEPS:
        trackers.log(reported(step, attempt=0), step)
        if step == CHECKPOINT_STEP:
            state = trackers.state_dict()
    trackers.close("failed")
    said: list[str] = []
    resumed = T.open_trackers(["mlflow"], run_dir=None, run_name="r", start_step=8, resume_state=state,
                              options=opts, say=said.append)
    assert resumed.state_dict() == state and resumed.backends[0].high_water == 12
    assert said == [f"mlflow: continuing mlflow run {state['mlflow']['run_id']} in {state['mlflow']['tracking_uri']}; "
                    f"steps 9-12 were logged before the restart and are not logged again"]
    resumed.close()
    assert list(tmp_path.iterdir()) == [tmp_path / "store"]  # nothing written beside the store
    # A run id the store does not know (another --mlflow-uri): a new run, and a line that says so.
    said.clear()
    other = T.open_trackers(["mlflow"], run_dir=None, run_name="r", start_step=8, say=said.append, options=opts,
                            resume_state={"mlflow": {"run_id": "0123456789abcdef", "tracking_uri": "elsewhere"}})
    assert other.state_dict()["mlflow"]["run_id"] != "0123456789abcdef" and other.backends[0].high_water == -1
    assert said == ["mlflow: run 0123456789abcdef of the checkpoint is not in "
                    f"{opts['mlflow_uri'].replace(str(tmp_path), 'sqlite:///' + str(tmp_path.resolve()))}; "
                    "starting a new MLflow run"]
    other.close()


# ---- W&B offline files ---------------------------------------------------------------------------

def wandb_records(path: Path):
    """Records of a .wandb file. W&B has no Python reader any more; the format is LevelDB's log
    format (32 KiB blocks of chunks: crc32, length, type) after a 7-byte ':W&B' header, each record
    a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room left in the block for a chunk header: padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break  # preallocated zeros: the end of what was written
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_offline(run_dir: Path) -> tuple[set[str], dict, list[tuple[int, dict]]]:
    """(run ids, config of the first segment, history in time order) of every offline segment."""
    segments = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        # W&B's service process writes the file after the client returns: on a loaded machine, give it 30 s
        deadline = time.monotonic() + 30
        while True:
            records = list(wandb_records(path))
            runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
            if runs or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert runs, f"{path}: no run record in {[r.WhichOneof('record_type') for r in records]}"
        run = runs[0]
        history = [(r.history.step.num,
                    {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
                   for r in records if r.WhichOneof("record_type") == "history"]
        config = {i.key: json.loads(i.value_json) for i in run.config.update}
        segments.append((run.start_time.ToNanoseconds(), run.run_id, config, history))
    segments.sort(key=lambda s: s[0])
    assert len(segments) == 2, "one offline segment per attempt"
    return {s[1] for s in segments}, segments[0][2], [h for s in segments for h in s[3]]


@pytest.mark.slow
def test_wandb_offline_keeps_one_run_and_never_appends_a_redone_step(failed_run):
    """W&B offline: both attempts write segments of one run id (`wandb sync` joins them); the step axis
    is strictly increasing and every point equals metrics.jsonl except the redone step 12 (first attempt's)."""
    run_ids, config, history = read_wandb_offline(failed_run)
    state = json.loads((failed_run / "state.json").read_text())["trackers"]["wandb"]
    assert run_ids == {state["run_id"]}
    steps = [step for step, _ in history]
    assert steps == [4, 8, 12, 16, 20]
    series: dict[str, list[tuple[int, float]]] = {}
    for step, items in history:
        assert items["_step"] == step
        for name, value in items.items():
            if not name.startswith("_"):
                series.setdefault(name, []).append((step, value))
    expected = jsonl_points(failed_run)
    expected[12] = T.flatten_metrics(reported(12, attempt=0))
    check_series(series, expected)
    assert config["model"] == HPARAMS["model"] and config["world_size"] == 2  # hyperparameters, once
    sidecar = json.loads((failed_run / T.SIDECAR).read_text())["trackers"]["wandb"]
    assert sidecar == {**state, "last_step": 20}


# ---- checks and messages ------------------------------------------------------------------------

@pytest.mark.parametrize("kind, module", [("tensorboard", "tensorboardX"), ("mlflow", "mlflow"), ("wandb", "wandb")])
def test_missing_package_names_the_extra(kind, module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    monkeypatch.setenv("WANDB_MODE", "offline")
    for call in (lambda: T.check_trackers([kind], run_dir=tmp_path),
                 lambda: T.open_trackers([kind], run_dir=tmp_path, run_name="r")):
        with pytest.raises(T.TrackerError) as e:
            call()
        message = str(e.value)
        assert f"pip install 'minilm[{kind}]'" in message and "\n" not in message, message


@contextlib.contextmanager
def answering_server():
    """An HTTP server on 127.0.0.1 that answers every request (404): its port."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_mlflow_sql_store_needs_sqlalchemy(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(T.TrackerError, match=r"sqlalchemy.*pip install 'minilm\[mlflow\]'"):
        T.check_trackers(["mlflow"], run_dir=tmp_path)
    with answering_server() as port:  # a server (here: one that answers HTTP) needs no SQL
        T.check_trackers(["mlflow"], {"mlflow_uri": f"http://127.0.0.1:{port}"}, run_dir=None)


def test_an_mlflow_server_that_does_not_answer_is_refused_in_seconds():
    """MLflow's own retries held the start ~270 s before its error: the driver's check says it at once, one line,
    the URI's password redacted."""
    pytest.importorskip("mlflow")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]  # closed below: nothing listens there any more
    t0 = time.monotonic()
    with pytest.raises(T.TrackerError) as e:
        T.check_trackers(["mlflow"], {"mlflow_uri": f"http://u:pw@127.0.0.1:{port}"}, run_dir=None)
    assert time.monotonic() - t0 < T.REACH_TIMEOUT_S + 1 and "\n" not in str(e.value)
    assert str(e.value).startswith(f"--mlflow-uri http://***@127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}")


@pytest.mark.parametrize("flags, kinds", [
    (None, []), ([], []), (["none"], []), ("tensorboard", ["tensorboard"]),
    (["tensorboard,mlflow", "wandb", "mlflow"], ["tensorboard", "mlflow", "wandb"]), (["MLflow"], ["mlflow"]),
])
def test_parse_kinds(flags, kinds):
    assert T.parse_kinds(flags) == kinds


@pytest.mark.parametrize("flags, message", [
    (["tensorbord"], "--tracker tensorbord: unknown tracker; choose from none, tensorboard, mlflow, wandb"),
    (["none", "wandb"], "--tracker none cannot be combined with other trackers"),
])
def test_bad_tracker_names(flags, message):
    with pytest.raises(T.TrackerError) as e:
        T.check_trackers(flags)
    assert str(e.value) == message


def test_checks_that_need_the_run_folder_or_a_key(monkeypatch, tmp_path):
    pytest.importorskip("tensorboardX")
    for check in (lambda: T.check_trackers(["tensorboard"], run_dir=None),  # in the driver, and in the worker
                  lambda: T.open_trackers(["tensorboard"], run_dir=None, run_name="r")):
        with pytest.raises(T.TrackerError, match="needs a local --run-dir"):
            check()
    if pytest.importorskip("mlflow"):
        with pytest.raises(T.TrackerError, match="needs --mlflow-uri"):
            T.check_trackers(["mlflow"], run_dir=None)
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("")
    monkeypatch.setenv("NETRC", str(netrc_file))
    with pytest.raises(T.TrackerError, match="no W&B API key"):
        T.check_trackers(["wandb"], run_dir=tmp_path)
    netrc_file.write_text("machine api.wandb.ai login user password k3y\n")
    netrc_file.chmod(0o600)
    assert T.check_trackers(["wandb"], run_dir=tmp_path) == ["wandb"]
    monkeypatch.setenv("NETRC", str(tmp_path / "missing"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert T.check_trackers(["wandb"], run_dir=tmp_path) == ["wandb"]


def test_mlflow_uri_defaults_to_sqlite_in_the_run_folder(tmp_path):
    assert T.mlflow_tracking_uri({}, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert T.mlflow_tracking_uri({"mlflow_uri": str(tmp_path / "x.db")}, None) == f"sqlite:///{tmp_path.resolve()}/x.db"
    assert T.mlflow_tracking_uri({"mlflow_uri": "http://mlflow:5000"}, tmp_path) == "http://mlflow:5000"


# ---- the pieces, without any tracker package ------------------------------------------------------

def test_flatten_metrics_names_list_elements():
    flat = T.flatten_metrics({"loss": 2.5, "world_size": 4, "ok": True, "run_id": "x", "none": None,
                              "expert_load": [[0.1, 0.9], [0.5, 0.5]], "nested": {"a": [1, 2]}})
    assert flat == {"loss": 2.5, "world_size": 4.0, "ok": 1.0, "expert_load/layer0/expert0": 0.1,
                    "expert_load/layer0/expert1": 0.9, "expert_load/layer1/expert0": 0.5,
                    "expert_load/layer1/expert1": 0.5, "nested/a/0": 1.0, "nested/a/1": 2.0}


def test_flatten_metrics_takes_numpy_and_torch_values():
    import numpy as np
    import torch

    flat = T.flatten_metrics({"a": np.float32(0.5), "b": torch.tensor(2.0), "c": np.array([[1.0, 2.0]])})
    assert flat == {"a": 0.5, "b": 2.0, "c/0/0": 1.0, "c/0/1": 2.0}


def test_hparams_flatten_and_code_version(monkeypatch):
    assert flatten_hparams({"model": {"h": 64}, "train": {"betas": [0.9, 0.95], "x": None}, "world_size": 2}) == \
        {"model.h": 64, "train.betas": "[0.9, 0.95]", "world_size": 2}
    monkeypatch.setenv("MINILM_GIT_COMMIT", "abc123")
    assert T.code_version() == {"git_commit": "abc123"}
    monkeypatch.delenv("MINILM_GIT_COMMIT")
    version = T.code_version()
    if (ROOT / ".git").exists():
        assert len(version["git_commit"]) == 40 and isinstance(version["git_dirty"], bool)
    assert T.code_version(code_dir=TESTS) == {}  # not the root of a checkout: omitted, not guessed


class Recorder(Backend):
    """A tracker that records what reaches it; fails at the steps in `fail_at`."""

    kind = "mlflow"

    def __init__(self, high_water=-1, fail_at=()):
        self.high_water, self.fail_at, self.points, self.closed = high_water, set(fail_at), [], None

    def write(self, scalars, step):
        if step in self.fail_at:
            raise ConnectionError("tracking server unreachable")
        self.points.append((step, scalars))

    def state(self):
        return {"run_id": "r1"}

    def describe(self):
        return "recorder"

    def close(self, outcome):
        self.closed = outcome


def test_redone_steps_skipped_failures_reported_and_sidecar_kept(tmp_path):
    said = []
    backend = Recorder(high_water=12, fail_at={20})
    trackers = T.Trackers([backend], sidecar=tmp_path / T.SIDECAR, say=said.append,
                          carried={"wandb": {"run_id": "w1", "project": "p"}})
    for step in (12, 16, 20, 24):
        trackers.log({"loss": 1.0 / step}, step)
    assert [s for s, _ in backend.points] == [16]  # 12 was already there; 20 failed and training went on
    assert len(said) == 1 and "could not log step 20" in said[0] and "ConnectionError" in said[0]
    backend.fail_at.clear()  # the tracker answers again: at its next try, it is caught up (#44 class 9)
    trackers._away["mlflow"]["retry_at"] = 0.0
    trackers.log({"loss": 1.0 / 28}, 28)
    assert [s for s, _ in backend.points] == [16, 20, 24, 28] and said[1].startswith("note: mlflow answers again")
    assert json.loads((tmp_path / T.SIDECAR).read_text())["trackers"]["mlflow"] == {"run_id": "r1", "last_step": 28}
    assert T._sidecar_last_step(tmp_path / T.SIDECAR, "mlflow", {"run_id": "r1"}) == 28
    assert T._sidecar_last_step(tmp_path / T.SIDECAR, "mlflow", {"run_id": "other"}) == -1
    # Trackers not opened this time keep their run ids in the resume state, for a later resume.
    assert trackers.state_dict() == {"version": 1, "wandb": {"run_id": "w1", "project": "p"},
                                     "mlflow": {"run_id": "r1"}}
    trackers.close("killed")
    assert backend.closed == "killed" and not trackers.backends


def test_no_tracker_is_a_no_op(tmp_path):
    trackers = T.open_trackers(["none"], run_dir=tmp_path, run_name="r", resume_state={"mlflow": {"run_id": "x"}})
    trackers.log({"loss": 1.0}, 1)
    assert not trackers.backends and trackers.state_dict() == {"version": 1, "mlflow": {"run_id": "x"}}
    trackers.close()
    assert list(tmp_path.iterdir()) == []


def test_scores_of_an_earlier_checkpoint_reach_each_tracker_at_their_step(tmp_path):
    # Scores beside training arrive after later steps were logged: TensorBoard and MLflow take them at the
    # checkpoint's step; W&B, which drops a step below its latest, on its own axis eval/step.
    from minilm.tracker_backends import Wandb

    said, backend = [], Recorder(high_water=40, fail_at={8})
    trackers = T.Trackers([backend], say=said.append)
    trackers.log_eval({"eval/cloze/acc": 0.5}, step=20)
    trackers.log_eval({"eval/cloze/acc": 0.25}, step=8)  # a failure: one warning, and nothing else stops
    assert backend.points == [(20, {"eval/cloze/acc": 0.5})] and backend.high_water == 40
    assert len(said) == 1 and "could not log the scores of step 8" in said[0]

    class FakeRun:
        def __init__(self):
            self.calls = []

        def define_metric(self, name, **kw):
            self.calls.append(("define", name, kw))

        def log(self, data, step=None):
            self.calls.append(("log", data, step))

    wandb = Wandb.__new__(Wandb)
    wandb.run, wandb.high_water = FakeRun(), 40
    wandb.write_eval({"eval/cloze/acc": 0.5}, 20)
    wandb.write_eval({"eval/cloze/acc": 0.75}, 44)
    assert wandb.run.calls == [("define", "eval/step", {}), ("define", "eval/*", {"step_metric": "eval/step"}),
                               ("log", {"eval/cloze/acc": 0.5, "eval/step": 20}, 40),
                               ("log", {"eval/cloze/acc": 0.75, "eval/step": 44}, 44)]
