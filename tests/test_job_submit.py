"""`ray job submit` end to end against a local head that `cluster/local.sh` starts for this module.

The head runs with token auth on (RAY_AUTH_MODE=token, a token file of its own), the dashboard on
127.0.0.1, free ports everywhere and its own temp dir, so it never meets the session's `ray.init()`
cluster or any other Ray on the machine; `cluster/local.sh stop` ends only its processes.

One training job runs through the module, slowed by MINILM_TEST_STEP_DELAY_S so that, while it
trains, the tests read its progress lines (`ray job logs`), the Train runs API, the custom metrics on
the Prometheus endpoint and the dashboard's job list in headless Chromium; then `ray job stop` and a
second submission with `--resume auto` that continues from the stopped job's checkpoint.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, make_prepared

from ray_jobs import dashboard_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]  # a cluster and its first job (~40 s)

RAY_CLI = str(Path(sys.executable).with_name("ray"))
LOCAL_SH = ROOT / "cluster" / "local.sh"
STEPS = 60
STEP_DELAY_S = "1.0"  # the first job: ~1 s a step leaves time to look at it, then stop it mid-run
REQUIRED_GAUGES = ["tokens_per_s", "loss", "lr", "mfu", "optimizer_step", "samples_seen"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
PROGRESS = re.compile(r"step (\d+)/(\d+) loss (\d+\.\d+)")


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env(**extra: str) -> dict:
    """This process's environment without any Ray address or token, plus `extra`."""
    drop = {"RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
            "MINILM_TEST_STEP_DELAY_S"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


@dataclass
class Head:
    dir: Path
    token_path: Path
    dashboard: str  # http://127.0.0.1:PORT
    dashboard_port: int
    metrics_url: str
    gcs_address: str
    home: Path  # an empty HOME: no ~/.ray/auth_token to fall back on
    prometheus: str  # http://127.0.0.1:PORT, the Prometheus local.sh starts beside the head
    started_s: float = 0.0
    jobs: dict = field(default_factory=dict)

    @property
    def token(self) -> str:
        return self.token_path.read_text().strip()

    def env(self, token: str | None = "file") -> dict:
        """Environment of a client: the head's token file, a literal token, or (None) no token at all."""
        # Ray's one-machine mode, as `eval "$(cluster/local.sh env)"` sets it (a driver here has the head's IP)
        env = clean_env(HOME=str(self.home), PYTHONUNBUFFERED="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        if token == "file":
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        elif token is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        return env

    def job_cli(self, verb: str, *args: str, token: str | None = "file",
                timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [RAY_CLI, "job", verb, "--address", self.dashboard, *args]
        return subprocess.run(cmd, cwd=ROOT, env=self.env(token), capture_output=True, text=True,
                              timeout=timeout)

    def api(self, path: str, token: str | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.dashboard + path)
        tok = self.token if token is None else token
        if tok:
            req.add_header("Authorization", f"Bearer {tok}")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def job(self, submission_id: str) -> dict:
        status, body = self.api(f"/api/jobs/{submission_id}")
        assert status == 200, (status, body[:500])
        return json.loads(body)

    def logs(self, submission_id: str) -> str:
        status, body = self.api(f"/api/jobs/{submission_id}/logs")
        assert status == 200, (status, body[:500])
        return json.loads(body)["logs"]

    def wait_job(self, submission_id: str, statuses: set[str], timeout: float) -> dict:
        deadline = time.time() + timeout
        while True:
            info = self.job(submission_id)
            if info["status"] in statuses or info["status"] in TERMINAL or time.time() > deadline:
                return info
            time.sleep(0.5)


def _local_sh(verb: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LOCAL_SH), verb], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def head():
    # A short temp dir: Ray's unix socket paths live under it.
    base = Path(tempfile.mkdtemp(prefix="mljs-", dir="/tmp"))
    port, dport, mport, agent, agent_grpc, renv, client, pport = free_ports(8)
    home = base / "home"
    home.mkdir()
    env = clean_env(MINILM_RAY_DIR=str(base / "head"), RAY=RAY_CLI, NUM_CPUS="8", RAY_PORT=str(port),
                    DASHBOARD_PORT=str(dport), METRICS_PORT=str(mport), DASHBOARD_AGENT_PORT=str(agent),
                    DASHBOARD_AGENT_GRPC_PORT=str(agent_grpc), RUNTIME_ENV_AGENT_PORT=str(renv),
                    CLIENT_PORT=str(client), RAY_AUTH_TOKEN_PATH=str(base / "token"), HOME=str(home),
                    PROMETHEUS_PORT=str(pport), PROMETHEUS_SCRAPE="1s")
    t0 = time.time()
    started = _local_sh("start", env)
    h = Head(dir=base, token_path=base / "token", dashboard=f"http://127.0.0.1:{dport}", dashboard_port=dport,
             metrics_url=f"http://127.0.0.1:{mport}/metrics", gcs_address=f"127.0.0.1:{port}", home=home,
             prometheus=f"http://127.0.0.1:{pport}", started_s=time.time() - t0)
    try:
        assert started.returncode == 0, \
            f"local.sh start failed:\n{started.stdout[-3000:]}\n{started.stderr[-3000:]}"
        yield h
    finally:
        stopped = _local_sh("stop", env, timeout=120)
        status = _local_sh("status", env, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
        assert stopped.returncode == 0, stopped.stderr
        assert status.returncode == 1, f"processes of the test head are left:\n{status.stdout}"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("jobdata") / "tiny240", num_sequences=240, seq_len=32,
                         vocab_size=256, rows_per_shard=100)


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jobruns")


def pretrain_entrypoint(data: Path, storage: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ray_jobs.pretrain", "--data", str(data), "--seq-len", "32",
            "--vocab-size", "256", "--hidden-size", "64", "--num-hidden-layers", "2",
            "--num-attention-heads", "4", "--num-key-value-heads", "2", "--max-steps", str(STEPS),
            "--warmup-steps", "2", "--micro-batch-size", "4", "--global-batch-size", "16", "--log-every", "2",
            "--checkpoint-every", "4", "--dtype", "fp32", "--num-workers", "1",
            "--run-dir", str(storage / name), *extra]


def submit(head: Head, submission_id: str, entrypoint: list[str], env_vars: dict | None = None,
           token: str | None = "file") -> subprocess.CompletedProcess:
    """`ray job submit --working-dir . --runtime-env cluster/runtime-env.yaml`, plus env_vars for this job."""
    runtime_env = yaml.safe_load((ROOT / "cluster" / "runtime-env.yaml").read_text())
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **(env_vars or {})}
    return head.job_cli("submit", "--submission-id", submission_id, "--no-wait", "--working-dir", ".",
                        "--runtime-env-json", json.dumps(runtime_env), "--", *entrypoint, token=token)


@pytest.fixture(scope="module")
def first_job(head, data, storage):
    """The training job the module watches: submitted once, stopped by the last test."""
    name = f"jobrun-{secrets.token_hex(3)}"
    sid = f"minilm-{name}"
    proc = submit(head, sid, pretrain_entrypoint(data, storage, name),
                  env_vars={"MINILM_TESTING": "1", "MINILM_TEST_STEP_DELAY_S": STEP_DELAY_S})
    assert proc.returncode == 0, f"submit failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return {"id": sid, "name": name, "submitted": time.time()}


def progress_steps(logs: str) -> list[int]:
    return [int(m.group(1)) for m in PROGRESS.finditer(logs)]


def wait_for_progress(head: Head, job: dict, min_step: int, timeout: float = 180) -> str:
    deadline = time.time() + timeout
    logs = ""
    while time.time() < deadline:
        logs = head.logs(job["id"])
        if max(progress_steps(logs), default=0) >= min_step:
            return logs
        info = head.job(job["id"])
        assert info["status"] not in TERMINAL, \
            f"job ended early: {info['status']} {info.get('message')}\n{logs[-3000:]}"
        time.sleep(2)
    raise AssertionError(f"no progress line for step >= {min_step} within {timeout}s:\n{logs[-3000:]}")


# --- security: token auth ---------------------------------------------------------------------------


def test_dashboard_listens_on_localhost_only_and_refuses_requests_without_the_token(head):
    import psutil

    listeners = {c.laddr.ip for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == head.dashboard_port}
    assert listeners == {"127.0.0.1"}, f"dashboard bound to {listeners}"
    assert head.api("/api/jobs/", token="")[0] == 401
    assert head.api("/api/jobs/", token="not-the-token")[0] == 403
    assert head.api("/api/jobs/")[0] == 200


def test_every_port_of_the_local_head_listens_on_loopback_only(head):
    """local.sh starts the head in Ray's one-machine mode: the GCS, raylet, agents and metrics port on loopback too."""
    import psutil

    ours = {p.pid for p in psutil.process_iter(["cmdline"]) if str(head.dir) in " ".join(p.info["cmdline"] or [])}
    ports = {int(head.gcs_address.rsplit(":", 1)[1]), head.dashboard_port, int(head.metrics_url.split(":")[2][:-8])}
    listeners = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and (c.pid in ours or c.laddr.port in ports)}
    assert ports <= {port for _, port in listeners} and len(listeners) > len(ports), listeners
    assert {ip for ip, _ in listeners} <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, listeners


GCS_CONNECT = """
import ray
try:
    ray.init(address={address!r}, logging_level="ERROR")
    print("CONNECTED", flush=True)
except Exception as e:
    print("REFUSED", type(e).__name__, flush=True)
"""


def test_job_submit_without_the_token_is_refused_and_with_it_succeeds(head, first_job):
    # A driver without the token cannot join through the GCS port either (Ray retries ~20 s first, while the
    # module's training job, submitted first, starts up).
    gcs = subprocess.Popen([sys.executable, "-c", GCS_CONNECT.format(address=head.gcs_address)],
                           env=head.env(None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    no_token = submit(head, "minilm-no-token", ["python", "-c", "print('should not run')"], token=None)
    assert no_token.returncode != 0
    assert "Authentication required" in no_token.stderr + no_token.stdout, no_token.stderr[-2000:]
    wrong = submit(head, "minilm-wrong-token", ["python", "-c", "print('should not run')"], token="x" * 64)
    assert wrong.returncode != 0
    assert "Authentication failed" in wrong.stderr + wrong.stdout, wrong.stderr[-2000:]
    for sid in ("minilm-no-token", "minilm-wrong-token"):
        assert head.api(f"/api/jobs/{sid}")[0] == 404  # never created

    # With the token: the job runs in the uploaded working dir, which leaves .gitignore'd paths out.
    listing = "import os, json; print('WORKDIR', json.dumps(sorted(os.listdir('.'))))"
    ok = submit(head, "minilm-token-ok", [sys.executable, "-c", listing])
    assert ok.returncode == 0, ok.stderr[-3000:]
    info = head.wait_job("minilm-token-ok", TERMINAL, timeout=120)
    logs = head.logs("minilm-token-ok")
    assert info["status"] == "SUCCEEDED", (info, logs[-2000:])
    line = [x for x in logs.splitlines() if x.startswith("WORKDIR ")]
    assert line, logs[-2000:]
    uploaded = json.loads(line[0].removeprefix("WORKDIR "))
    assert {"ray_jobs", "minilm", "cluster", "pyproject.toml"} <= set(uploaded), uploaded
    assert not {".venv", ".git", "runs", "data"} & set(uploaded), uploaded

    out, _ = gcs.communicate(timeout=120)
    assert "REFUSED" in out and "CONNECTED" not in out, out[-2000:]
    assert "Authentication token is missing or incorrect" in out, out[-2000:]


# --- a training job: logs, Train runs API, metrics, dashboard page ----------------------------------------


def test_ray_job_logs_show_the_progress_lines(head, first_job):
    wait_for_progress(head, first_job, min_step=4)
    proc = head.job_cli("logs", first_job["id"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"starting run {first_job['name']} fresh" in proc.stdout
    steps = progress_steps(proc.stdout)
    assert steps and steps == sorted(steps) and steps[0] == 2, steps
    assert all(int(m.group(2)) == STEPS for m in PROGRESS.finditer(proc.stdout))


def test_train_runs_api_lists_the_run_of_the_job(head, first_job):
    deadline = time.time() + 60
    while True:
        status, body = head.api("/api/train/v2/runs/v1")
        runs = json.loads(body)["train_runs"] if status == 200 else []
        mine = [r for r in runs if r["name"] == first_job["name"]]
        if mine or time.time() > deadline:
            break
        time.sleep(2)
    assert status == 200, body[:1000]
    assert len(mine) == 1, [r["name"] for r in runs]
    run = mine[0]
    assert run["status"] in ("INITIALIZING", "SCHEDULING", "RUNNING"), run["status"]
    assert run["job_details"]["submission_id"] == first_job["id"]
    config = run["run_settings"]["train_loop_config"]
    assert config["run"]["name"] == first_job["name"] and config["train"]["max_steps"] == STEPS
    assert run["run_settings"]["run_config"]["name"] == first_job["name"]


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)", line)
        if not m or line.startswith("#"):
            continue
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def test_custom_metrics_are_exported_for_prometheus(head, first_job):
    names = ["ray_minilm_" + k for k in REQUIRED_GAUGES]
    assert set(names) <= set(dashboard_metrics.metric_names())
    deadline = time.time() + 90
    values: dict[str, float] = {}
    while time.time() < deadline:
        with urllib.request.urlopen(head.metrics_url, timeout=30) as r:
            metrics = parse_prometheus(r.read().decode())
        values = {n: v for n in names for labels, v in metrics.get(n, [])
                  if labels.get("run") == first_job["name"]}
        if len(values) == len(names) and values["ray_minilm_optimizer_step"] >= 2:
            break
        time.sleep(3)
    assert set(values) == set(names), f"missing: {sorted(set(names) - set(values))}"
    assert values["ray_minilm_optimizer_step"] >= 2
    assert values["ray_minilm_samples_seen"] > 0 and values["ray_minilm_samples_seen"] % 16 == 0
    assert math.isfinite(values["ray_minilm_loss"]) and values["ray_minilm_loss"] > 0
    assert values["ray_minilm_tokens_per_s"] > 0 and values["ray_minilm_lr"] > 0
    assert 0 <= values["ray_minilm_mfu"] < 1


def prometheus_query(head: Head, path: str) -> dict:
    with urllib.request.urlopen(head.prometheus + path, timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.skipif(not shutil.which("prometheus"), reason="no prometheus binary: apt-get install prometheus "
                    "(.ci/run does)")
def test_a_real_prometheus_holds_the_job_s_gauges_and_every_dashboard_query(head, first_job):
    # local.sh started Prometheus beside the head (scraping every second here) and told the dashboard where it is
    from test_grafana_dashboard import DASHBOARD, gauges_in, queries

    status, body = head.api("/api/prometheus_health")
    assert status == 200, body[:300]
    run = first_job["name"]
    deadline, values = time.time() + 120, {}
    while time.time() < deadline:
        values = {}
        for gauge in REQUIRED_GAUGES:
            query = urllib.parse.quote(f'ray_minilm_{gauge}{{run="{run}"}}')
            for sample in prometheus_query(head, f"/api/v1/query?query={query}")["result"]:
                values[gauge] = float(sample["value"][1])
        if len(values) == len(REQUIRED_GAUGES) and values["optimizer_step"] >= 2:
            break
        time.sleep(2)
    assert set(values) == set(REQUIRED_GAUGES), f"not in Prometheus: {sorted(set(REQUIRED_GAUGES) - set(values))}"
    assert values["optimizer_step"] >= 2 and values["samples_seen"] > 0 and values["tokens_per_s"] > 0
    assert math.isfinite(values["loss"]) and values["loss"] > 0 and 0 <= values["mfu"] < 1
    # Every gauge a panel of the shipped Grafana dashboard queries is a series Prometheus holds for this run
    match = urllib.parse.quote(f'{{run="{run}"}}')
    held = set(prometheus_query(head, f"/api/v1/label/__name__/values?match[]={match}"))
    panels = json.loads(DASHBOARD.read_text())["panels"]
    wanted = {name for panel in panels for expr in queries(panel) for name in gauges_in(expr)}
    # the GPU memory panel's gauges come from a CUDA device only (minilm.progress.cuda_peak_memory): a CPU run has none
    gpu_only = {"ray_minilm_cuda_peak_allocated_gib", "ray_minilm_cuda_peak_reserved_gib"}
    assert gpu_only <= wanted and not gpu_only & held
    wanted -= gpu_only
    assert wanted and wanted <= held, f"queried by the dashboard, not in Prometheus: {sorted(wanted - held)}"


class _TokenProxy:
    """127.0.0.1 proxy that adds the head's token to every request, as a browser session cookie would.

    Headless Chromium cannot type the token into the dashboard's login dialog, so it talks to this.
    """

    HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
           "host", "proxy-authorization", "proxy-authenticate"}

    def __init__(self, port: int, token: str):
        hop = self.HOP

        class Handler(BaseHTTPRequestHandler):
            def forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                headers["Authorization"] = f"Bearer {token}"
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in hop:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_POST = forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def chromium(url: str, profile: Path, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
                           "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
                           "--window-size=1400,900", "--virtual-time-budget=15000", *mode, url],
                          capture_output=True, text=True, timeout=120)


def visible_text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return " ".join(re.sub(r"<[^>]+>", " ", dom).split())


def test_dashboard_job_list_in_headless_chromium(head, first_job, tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it with apt-get; that install "
                    "failed or was skipped), so the dashboard page cannot be rendered")
    proxy = _TokenProxy(head.dashboard_port, head.token)
    try:
        # Straight to the dashboard, the page asks for the token and lists nothing.
        bare = visible_text(chromium(f"{head.dashboard}/#/jobs", tmp_path / "profile0", "--dump-dom").stdout)
        assert "Authentication Token Required" in bare and first_job["id"] not in bare, bare[:2000]
        dom = chromium(f"{proxy.url}/#/jobs", tmp_path / "profile1", "--dump-dom")
        text = visible_text(dom.stdout)
        assert first_job["id"] in text, \
            f"job not listed; page text: {text[:3000]}\nstderr: {dom.stderr[-2000:]}"
        assert "ray_jobs.pretrain" in text
        shot = Path(os.environ.get("MINILM_SCREENSHOT_DIR") or tmp_path) / "dashboard-jobs.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        chromium(f"{proxy.url}/#/jobs", tmp_path / "profile2", f"--screenshot={shot}")
        assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    finally:
        proxy.close()


# --- stop, then resume -----------------------------------------------------------------------------


def complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in run_dir.glob("checkpoint_*/COMPLETE.json"))


@pytest.mark.slow  # a stopped job and a second, resumed one
def test_ray_job_stop_leaves_a_checkpoint_and_resume_auto_continues(head, first_job, data, storage):
    run_dir = storage / first_job["name"]
    deadline = time.time() + 180
    while not [s for s in complete_steps(run_dir) if s >= 8] and time.time() < deadline:
        info = head.job(first_job["id"])
        assert info["status"] not in TERMINAL, f"the job ended before it could be stopped: {info['status']}"
        time.sleep(1)
    assert [s for s in complete_steps(run_dir) if s >= 8], f"no checkpoint at step >= 8 in {run_dir}"

    stop = head.job_cli("stop", first_job["id"], timeout=120)
    assert stop.returncode == 0, stop.stderr[-2000:]
    info = head.wait_job(first_job["id"], TERMINAL, timeout=60)
    assert info["status"] == "STOPPED", info
    # The driver's actors (Train controller, workers) go with it: wait until no checkpoint appears for 5 s (longer
    # than the job's checkpoint interval, 4 steps of ~1 s).
    saved, stable_since, deadline = complete_steps(run_dir), time.time(), time.time() + 60
    while time.time() - stable_since < 5 and time.time() < deadline:
        time.sleep(0.5)
        now = complete_steps(run_dir)
        if now != saved:
            saved, stable_since = now, time.time()
    assert saved and max(saved) < STEPS, f"stopped run has checkpoints {saved}"
    stopped_logs = head.logs(first_job["id"])
    assert max(progress_steps(stopped_logs)) < STEPS

    # The same command again (resume auto is the default): it continues from the latest complete checkpoint.
    sid = first_job["id"] + "-resume"
    proc = submit(head, sid, pretrain_entrypoint(data, storage, first_job["name"], "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = head.wait_job(sid, TERMINAL, timeout=240)
    logs = head.logs(sid)
    assert info["status"] == "SUCCEEDED", f"{info}\n{logs[-4000:]}"
    m = re.search(rf"resumed run {first_job['name']} at optimizer step (\d+)", logs)
    assert m, logs[-4000:]
    resumed_at = int(m.group(1))
    assert resumed_at in saved and resumed_at > 0, (resumed_at, saved)
    steps = progress_steps(logs)
    assert steps and min(steps) > resumed_at and max(steps) == STEPS, steps
    assert f"steps {STEPS}/{STEPS}" in logs
    assert (run_dir / f"checkpoint_{STEPS:08d}" / "COMPLETE.json").is_file()
