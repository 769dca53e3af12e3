"""cluster/: every config parses, has what it needs, passes Ray's own offline validation, names
entrypoints that the pretrain CLI accepts, and never exposes the dashboard without auth.
Also the dashboard metrics module, with a fake Gauge. No Ray cluster is started here."""

from __future__ import annotations

import copy
import importlib.util
import math
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from minilm.options import build_configs
from ray_jobs import dashboard_metrics
from ray_jobs.cli import RayOptions
from ray_jobs.pretrain import build_parser, check_options

CLUSTER = ROOT / "cluster"
YAMLS = sorted(CLUSTER.glob("*.yaml"))
KUBERAY_CLUSTERS = {"kuberay-raycluster.yaml": lambda d: d["spec"],
                    "kuberay-rayjob.yaml": lambda d: d["spec"]["rayClusterSpec"]}


def load(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all((CLUSTER / name).read_text()) if d is not None]
    assert len(docs) == 1, f"{name}: expected one YAML document, got {len(docs)}"
    return docs[0]


def entrypoint_args(command: str, module: str = "ray_jobs.pretrain") -> list[str]:
    """The arguments after `python -m MODULE` in a shell command line."""
    words = shlex.split(command)
    i = words.index("-m")
    assert words[i + 1] == module, command
    return words[i + 2:]


def parse_pretrain(args: list[str]):
    """What `python -m ray_jobs.pretrain ARGS` checks before it needs data or Ray: flags and configs."""
    ns = build_parser().parse_args(args)  # SystemExit(2) on an unknown or malformed flag
    model, train, run = build_configs(ns, {}, RayOptions, demo=not ns.data)
    check_options(model, train, run)  # pretrain's own checks before it needs data
    lo, hi = run.workers
    # every worker needs a sequence of the global batch
    assert 1 <= lo <= hi <= train.global_batch_size, f"{args}: world sizes {lo}-{hi}, {train.global_batch_size} a step"
    return ns, model, train, run


def test_the_cluster_folder_has_its_files():
    names = {p.name for p in CLUSTER.iterdir()}
    assert {"aws.yaml", "kuberay-raycluster.yaml", "kuberay-rayjob.yaml", "kuberay-storage.yaml",
            "runtime-env.yaml", "local.sh", "README.md", "Dockerfile"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_every_yaml_parses_to_a_mapping(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


# --- the cluster launcher config (AWS) ------------------------------------------------------------


def test_aws_config_passes_rays_schema_validation():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws.yaml")
    prepared = prepare_config(copy.deepcopy(config))  # merges Ray's AWS defaults, as `ray up` does
    validate_config(prepared)  # ray-schema.json plus the node-type checks of `ray up`
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] in types
    workers = {k: v for k, v in types.items() if k != prepared["head_node_type"]}
    instance_types = {v["node_config"]["InstanceType"] for v in workers.values()}
    assert {"g5.xlarge", "p4d.24xlarge"} <= instance_types
    for name, t in workers.items():
        assert 0 <= t["min_workers"] <= t["max_workers"], name
    assert prepared["max_workers"] == sum(t["max_workers"] for t in workers.values())
    assert types[prepared["head_node_type"]]["resources"] == {"CPU": 0}, "no training on the head"


def test_aws_config_installs_the_project_and_turns_token_auth_on():
    config = load("aws.yaml")
    assert config["file_mounts"]["~/minilm"] == "."
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert ".gitignore" in config["rsync_filter"]
    assert any("pip install" in c and "~/minilm" in c for c in config["setup_commands"])
    head = " ".join(config["head_start_ray_commands"])
    worker = " ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head and "RAY_AUTH_MODE=token" in head
    assert "--dashboard-host=127.0.0.1" in head
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker and "RAY_AUTH_MODE=token" in worker
    # The dashboard is reached through `ray dashboard` (SSH): no security group rule opens it.
    assert "8265" not in yaml.safe_dump(config.get("provider", {}))


# --- KubeRay ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(KUBERAY_CLUSTERS))
def test_kuberay_cluster_spec_is_what_the_kuberay_autoscaler_accepts(name):
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    doc = load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"] and doc["metadata"]["namespace"]
    spec = KUBERAY_CLUSTERS[name](doc)
    cr = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": doc["metadata"], "spec": spec}
    # What the KubeRay autoscaler derives from the RayCluster: validated against Ray's schema on the way.
    derived = _derive_autoscaling_config_from_ray_cr(copy.deepcopy(cr))
    gpu = derived["available_node_types"]["gpu"]
    assert gpu["resources"]["GPU"] == 1
    assert (gpu["min_workers"], gpu["max_workers"]) == (2, 4)
    assert spec["enableInTreeAutoscaling"] is True
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


# Field names of the ray.io/v1 CRDs (KubeRay 1.5-1.7 API reference), to catch a misspelt key: the
# CRD schemas themselves are not available offline.
RAYCLUSTER_SPEC = {"authOptions", "suspend", "managedBy", "autoscalerOptions", "headServiceAnnotations",
                   "enableInTreeAutoscaling", "gcsFaultToleranceOptions", "headGroupSpec", "rayVersion",
                   "workerGroupSpecs", "upgradeStrategy"}
HEAD_GROUP = {"template", "headService", "enableIngress", "resources", "labels", "rayStartParams",
              "serviceType"}
WORKER_GROUP = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds",
                "resources", "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts"}
AUTOSCALER_OPTIONS = {"resources", "image", "imagePullPolicy", "securityContext", "idleTimeoutSeconds",
                      "upscalingMode", "version", "env", "envFrom", "volumeMounts"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
               "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
               "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend"}


@pytest.mark.parametrize("name", sorted(KUBERAY_CLUSTERS))
def test_kuberay_manifests_use_only_known_crd_fields(name):
    doc = load(name)
    spec = KUBERAY_CLUSTERS[name](doc)
    if doc["kind"] == "RayJob":
        assert set(doc["spec"]) <= RAYJOB_SPEC, set(doc["spec"]) - RAYJOB_SPEC
        assert doc["spec"]["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
    assert set(spec) <= RAYCLUSTER_SPEC, set(spec) - RAYCLUSTER_SPEC
    assert set(spec["headGroupSpec"]) <= HEAD_GROUP
    assert set(spec["autoscalerOptions"]) <= AUTOSCALER_OPTIONS
    assert spec["autoscalerOptions"]["upscalingMode"] in ("Default", "Conservative", "Aggressive")
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), "rayStartParams: strings"


@pytest.mark.parametrize("name", sorted(KUBERAY_CLUSTERS))
def test_kuberay_token_auth_on_and_dashboard_inside_the_cluster_only(name):
    spec = KUBERAY_CLUSTERS[name](load(name))
    assert spec["authOptions"]["mode"] == "token"
    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert "ingress" not in yaml.safe_dump(spec).lower()


@pytest.mark.parametrize("name", sorted(KUBERAY_CLUSTERS))
def test_kuberay_pods_mount_the_shared_volume(name):
    spec = KUBERAY_CLUSTERS[name](load(name))
    storage = load("kuberay-storage.yaml")
    assert storage["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in storage["spec"]["accessModes"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims == {"shared": storage["metadata"]["name"]}
        mounts = {m["name"]: m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert mounts["shared"] == "/shared"


def test_kuberay_rayjob_runs_the_pretrain_module_with_valid_flags():
    job = load("kuberay-rayjob.yaml")
    assert job["kind"] == "RayJob"
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    args = entrypoint_args(job["spec"]["entrypoint"])
    assert importlib.util.find_spec("ray_jobs.pretrain") is not None
    assert (ROOT / "ray_jobs" / "pretrain.py").is_file()
    ns, model, train, run = parse_pretrain(args)
    # Checkpoints on the shared volume (or object storage), resumable by name.
    assert run.storage_path.startswith(("/shared/", "s3://", "gs://"))
    assert run.data.startswith("/shared/")
    assert run.resume == "auto" and run.name
    # Elastic: MIN-MAX Train workers = the gpu group's min/max replicas x 1 GPU, and every world size
    # in between keeps the global batch (pretrain refuses the run otherwise).
    lo, hi = (int(x) for x in run.num_workers.split("-"))
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert (lo, hi) == (group["minReplicas"] * gpus, group["maxReplicas"] * gpus)
    assert 1 <= lo <= hi <= train.global_batch_size
    assert run.use_gpu == "true"


def test_kuberay_manifests_and_images_agree_on_one_ray_version():
    versions = set()
    for name, get in KUBERAY_CLUSTERS.items():
        spec = get(load(name))
        versions.add(spec["rayVersion"])
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            for c in group["template"]["spec"]["containers"]:
                versions.update(re.findall(r"ray(\d+\.\d+\.\d+)", c["image"]))
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    versions.update(re.findall(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)-", dockerfile, re.M))
    aws = load("aws.yaml")["docker"]
    for image in (aws["head_image"], aws["worker_image"]):
        versions.update(re.findall(r"rayproject/ray:(\d+\.\d+\.\d+)-", image))
    assert len(versions) == 1, versions


# --- docs, runtime env, local head ------------------------------------------------------------------


def test_readme_covers_launch_submit_watch_resume_teardown_storage_and_elastic():
    text = (CLUSTER / "README.md").read_text()
    for needle in ("ray up cluster/aws.yaml", "ray dashboard cluster/aws.yaml", "ray job submit", "shared",
                   "ray job logs", "ray job stop", "--resume auto", "ray down cluster/aws.yaml",
                   "kubectl apply", "kubectl port-forward", "cluster/local.sh start", "cluster/local.sh stop",
                   "min_workers", "minReplicas", "--num-workers 2-4", "RAY_AUTH_MODE=token", "ray_minilm_"):
        assert needle in text, needle


def test_runtime_env_leaves_git_and_local_data_out():
    env = load("runtime-env.yaml")
    assert ".git" in env["excludes"] and ".venv" in env["excludes"]
    # Matched the way Ray's upload matches them: a top-level data/ goes, the minilm.data package stays.
    from ray._private.runtime_env.packaging import _get_excludes

    excluded = _get_excludes(Path("."), env["excludes"])
    assert excluded(Path("data/tok/shard-00000.bin")) and not excluded(Path("minilm/data/__init__.py"))
    assert env["env_vars"]["RAY_TRAIN_ENABLE_STATE_TRACKING"] == "1"


def test_no_config_or_doc_opens_the_dashboard_to_all_interfaces_without_auth():
    # Only the KubeRay head binds the pod network (token auth on, ClusterIP; checked above).
    for name in ("aws.yaml", "local.sh", "README.md", "runtime-env.yaml"):
        assert "0.0.0.0" not in (CLUSTER / name).read_text(), name
    local = (CLUSTER / "local.sh").read_text()
    assert "--dashboard-host 127.0.0.1" in local and "export RAY_AUTH_MODE=token" in local
    for name in KUBERAY_CLUSTERS:
        text = (CLUSTER / name).read_text()
        for kind in ("LoadBalancer", "NodePort", "kind: Ingress", "kind: Service"):
            assert kind not in text, (name, kind)


PRIVATE_PORTS = ("6379", "8265", "10001", "8080")


@pytest.mark.parametrize("name", ["aws.yaml", *sorted(KUBERAY_CLUSTERS)])
def test_each_cluster_config_says_which_ports_stay_private_and_keeps_token_auth(name):
    text = (CLUSTER / name).read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    said = header[header.index("Ports that stay private"):]
    assert all(port in said.split("Reach")[0] for port in PRIVATE_PORTS), said
    if name == "aws.yaml":
        assert "RAY_AUTH_MODE=token" in " ".join(load(name)["head_start_ray_commands"])
    else:
        assert KUBERAY_CLUSTERS[name](load(name))["authOptions"] == {"mode": "token"}


def local_sh(verb: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """cluster/local.sh with a stand-in `ray` that records its arguments (no Ray is started)."""
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nenv > "$(dirname "$0")/env"\n')
    fake.chmod(0o755)
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "RAY": str(fake), "RAY_AUTH_TOKEN": "t",
            "PROMETHEUS": "none"}  # a real one beside the stand-in head would outlive the test
    return subprocess.run(["bash", str(CLUSTER / "local.sh"), verb], env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


def test_local_head_binds_every_port_to_loopback_and_keeps_its_state_private(tmp_path):
    started = local_sh("start", tmp_path)
    assert started.returncode == 0, started.stderr
    args = (tmp_path / "bin" / "args").read_text().split()
    assert args[args.index("--node-ip-address") + 1] == "127.0.0.1"  # GCS, raylet and metrics port: loopback
    # without it Ray resolves the node IP to the routable one
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in (tmp_path / "bin" / "env").read_text().splitlines()
    assert args[args.index("--dashboard-host") + 1] == "127.0.0.1"
    state_dir = tmp_path / "home" / ".cache" / "minilm" / "ray"  # no XDG_RUNTIME_DIR: under the home
    assert args[args.index("--temp-dir") + 1] == str(state_dir / "ray")
    assert oct(state_dir.stat().st_mode & 0o777) == "0o700"
    assert oct((state_dir / "head.env").stat().st_mode & 0o777) == "0o600"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    assert local_sh("start", tmp_path, XDG_RUNTIME_DIR=str(runtime)).returncode == 0
    assert (runtime / "minilm-ray" / "head.env").is_file()


def test_local_sh_refuses_a_state_folder_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    refused = local_sh("start", tmp_path, MINILM_RAY_DIR=str(shared))
    assert refused.returncode == 2 and "no one else can write to" in refused.stderr
    assert not (tmp_path / "bin" / "args").exists()  # nothing was started


def test_local_sh_env_prints_only_checked_values_and_nothing_runs_from_the_state_file(tmp_path):
    state = tmp_path / "head"
    assert local_sh("start", tmp_path, MINILM_RAY_DIR=str(state), RAY_AUTH_TOKEN_PATH="/home/u/.ray/tok").returncode == 0
    planted = tmp_path / "pwned"
    with open(state / "head.env", "a") as f:  # what a state file another user could write would hold
        f.write(f"RAY_API_SERVER_ADDRESS=http://127.0.0.1:1; touch {planted}\n"
                f"RAY_AUTH_TOKEN_PATH=/x$(touch {planted})\nRAY_API_SERVER_ADDRESS=`touch {planted}`\n")
    env = local_sh("env", tmp_path, MINILM_RAY_DIR=str(state))
    assert env.returncode == 0, env.stderr
    assert env.stdout.splitlines() == ["export RAY_API_SERVER_ADDRESS=http://127.0.0.1:8265",
                                       "export RAY_AUTH_TOKEN_PATH=/home/u/.ray/tok", "export RAY_AUTH_MODE=token",
                                       "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"]
    evaluated = subprocess.run(["bash", "-c", 'eval "$(cat)"; echo "$RAY_API_SERVER_ADDRESS"'], input=env.stdout,
                               capture_output=True, text=True)
    assert evaluated.stdout.strip() == "http://127.0.0.1:8265" and not planted.exists()


def test_local_sh_is_valid_bash_and_explains_itself():
    assert subprocess.run(["bash", "-n", str(CLUSTER / "local.sh")]).returncode == 0
    usage = subprocess.run(["bash", str(CLUSTER / "local.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "start|env|status|stop" in usage.stderr


# --- dashboard metrics --------------------------------------------------------------------------------


class FakeGauge:
    made: list = []

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.description, self.tag_keys, self.values = name, description, tag_keys, []
        FakeGauge.made.append(self)

    def set(self, value, tags=None):
        self.values.append((value, tags))


def fresh_dashboard_state(monkeypatch) -> None:
    """This process's gauges not made yet and publishing not disabled; monkeypatch puts the module's state back."""
    for name, value in (("_gauges", None), ("_disabled", False), ("_eval_gauge", None)):
        monkeypatch.setattr(dashboard_metrics, name, value)


@pytest.fixture
def fake_gauges(monkeypatch):
    FakeGauge.made = []
    monkeypatch.setattr("ray.util.metrics.Gauge", FakeGauge)
    fresh_dashboard_state(monkeypatch)
    return FakeGauge


def test_publish_sets_tagged_gauges_once_per_process(fake_gauges):
    metrics = {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.25, "optimizer_step": 10,
               "samples_seen": 160, "grad_norm": float("nan"), "world_size": True,
               "expert_load": [[0.5, 0.5]]}
    dashboard_metrics.publish(metrics, "run1")
    dashboard_metrics.publish({**metrics, "optimizer_step": 12}, "run1")
    by_name = {g.name: g for g in fake_gauges.made}
    assert len(fake_gauges.made) == len(dashboard_metrics.GAUGES), "gauges are created once, not per call"
    for key in ("tokens_per_s", "loss", "lr", "mfu", "optimizer_step", "samples_seen"):
        assert "ray_minilm_" + key in dashboard_metrics.metric_names()
        g = by_name["minilm_" + key]
        assert g.tag_keys == ("run",) and g.description
        assert g.values[-1][1] == {"run": "run1"}
    assert by_name["minilm_optimizer_step"].values == [(10.0, {"run": "run1"}), (12.0, {"run": "run1"})]
    assert by_name["minilm_grad_norm"].values == []  # not finite: skipped
    assert by_name["minilm_world_size"].values == []  # a bool is not a measurement
    assert by_name["minilm_eta_s"].values == []  # absent
    assert all(math.isfinite(v) for g in fake_gauges.made for v, _ in g.values)


def test_publish_eval_sets_one_gauge_tagged_by_task_and_metric(fake_gauges):
    records = [{"task": "cloze", "kind": "hellaswag", "metrics": {"acc": 0.5, "acc_norm": 0.25}},
               {"task": "held", "kind": "bpb", "metrics": {"bpb": 2.5, "nats_per_token": float("nan")}},
               {"task": "samples", "kind": "generate", "metrics": {"prompts": 4}}]
    dashboard_metrics.publish_eval(records, "run1")
    dashboard_metrics.publish_eval(records[:1], "run1")
    [gauge] = fake_gauges.made
    assert gauge.name == "minilm_eval" and gauge.tag_keys == ("run", "task", "metric")
    assert gauge.values == [(0.5, {"run": "run1", "task": "cloze", "metric": "acc"}),
                            (0.25, {"run": "run1", "task": "cloze", "metric": "acc_norm"}),
                            (2.5, {"run": "run1", "task": "held", "metric": "bpb"}),
                            (0.5, {"run": "run1", "task": "cloze", "metric": "acc"}),
                            (0.25, {"run": "run1", "task": "cloze", "metric": "acc_norm"})]


def test_publish_never_raises_and_stops_after_a_failure(monkeypatch, caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("no metrics agent")

    monkeypatch.setattr("ray.util.metrics.Gauge", broken)
    fresh_dashboard_state(monkeypatch)
    dashboard_metrics.publish({"loss": 1.0}, "run1")
    dashboard_metrics.publish({"loss": 1.0}, "run1")
    assert len(calls) == 1 and "dashboard metrics disabled" in caplog.text


def test_publish_outside_ray_is_a_no_op(monkeypatch, caplog):
    """No ray.init(): nothing to export to. Publishing neither starts a Ray nor warns nor turns itself off."""
    import ray

    fresh_dashboard_state(monkeypatch)
    assert not ray.is_initialized()
    for _ in range(2):
        assert dashboard_metrics.publish({"loss": 1.0, "lr": 0.1}, "run1") is None
        assert dashboard_metrics.publish_eval([{"task": "t", "kind": "choice", "metrics": {"acc": 0.5}}], "run1") is None
    assert not ray.is_initialized() and not dashboard_metrics._disabled and caplog.records == []
