"""bench/gpu_check.sh off a GPU: the rehearsal of the lent machine (a clean venv of the image's packages, no Ray,
the bundle installed by its own line, then the CPU dry run), the results it leaves under $OUT when stopped, the
table without Ray, and the code paths that differ on the lent image's torch 2.11."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT

from bench.gpu_bundle import canonical, image_packages
from bench.gpu_check import FILES, Part, Runner, table_rows

PARTS = ["preflight", "step-26m-eager", "step-104m-eager", "trainer", "ddp1-26m", "trainer-ddp1-26m", "fp16", "step-26m-compiled",
         "step-104m-compiled", "moe-26m-eager", "moe-26m-compiled", "docmask-26m-compiled", "muon-26m-compiled",
         "ac-104m-compiled", "checkpoint-104m", "checkpoint-stall-104m", "prepare", "ray-job", "ray-job-resume", "export", "sample", "stream"]


def image_venv(dest: Path) -> Path:
    """A venv holding only what the lent image holds: every package of this project's venv that the image's list
    names (torch 2.13 CPU, numpy, pyarrow, tokenizers, pyyaml, safetensors, pip, ...), linked in, no Ray."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next(dest.glob("lib/python*/site-packages"))
    image = image_packages()
    for dist in md.distributions():
        if canonical(dist.metadata["Name"]) not in image:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return dest / "bin" / "python"


def bare_env(**extra: str) -> dict:
    """This environment without the venv, the pip settings and any Ray or PYTHONPATH: as on the lent machine."""
    drop = ("PIP_", "RAY_", "VIRTUAL_ENV", "PYTHONPATH", "MINILM_BENCH_RESULTS", "OUT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="session")
def gpu_bundle(tmp_path_factory) -> Path:
    """The bundle for this machine's python (the lent image's cp312 bundle's twin), built once per session."""
    out = tmp_path_factory.mktemp("bundle") / "gpu-bundle"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_bundle.sh"), "--python-version", version, "--output",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.slow
@pytest.mark.ray
def test_rehearsal_on_the_image_packages_and_the_bundle(gpu_bundle, tmp_path):
    # The proof that the GPU run lacks nothing: bench/gpu_check.sh --bundle in a venv of the image's packages, Ray
    # and its missing needs only from the bundle, every part of the dry run ok. Its own local Ray (one for all the
    # Ray parts), so this test never joins the session's.
    manifest = json.loads((gpu_bundle / "bundle.json").read_text())
    assert manifest["total_bytes"] < 60 * 2**20
    python = image_venv(tmp_path / "venv")
    no_ray = subprocess.run([python, "-c", "import ray"], capture_output=True, text=True, env=bare_env())
    assert no_ray.returncode == 1 and "No module named 'ray'" in no_ray.stderr
    out, site = tmp_path / "out", tmp_path / "site"
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--bundle", str(gpu_bundle)],
                          env=bare_env(PYTHON=str(python), OUT=str(out), MINILM_BUNDLE_SITE=str(site)),
                          capture_output=True, text=True, timeout=1600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert (site / "ray" / "__init__.py").is_file() and not (site / "ray" / "jars").exists()
    assert sorted(p.name for p in out.rglob("*")) == sorted(FILES)  # 3 files, no folder: within the 8 that return
    result = json.loads((out / "gpu_check.json").read_text())
    assert {name: part["status"] for name, part in result["parts"].items()} == dict.fromkeys(PARTS, "ok")
    assert result["finished"] == "finished"
    table = {row["check"]: row for row in result["table"]}
    assert table["step 104M bf16 compiled"]["goal"] == ">= 45% MFU"
    assert {row["status"] for name, row in table.items() if not name.startswith("fp16")} == {"dry run"}
    assert table["preflight"]["result"].startswith(f"torch {torch.__version__}") and "ray 2.60.0" in table["preflight"]["result"]
    figures = result["figures"]
    rows = figures["rows"]
    assert set(rows) == {p for p in PARTS if p.endswith(("-eager", "-compiled"))}
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0, name
        assert (row["compile_s"] is not None) == name.endswith("-compiled"), name
        assert f"[{name}] row: {row['tokens_per_s']:,.0f} tok/s" in proc.stdout  # printed as it was measured
    assert rows["step-26m-compiled"]["graph_breaks"] == 0 and rows["step-26m-compiled"]["recompiles"] == 0
    profile = rows["step-26m-compiled"]["profile"]  # one profiled step: its top ops (CPU here)
    assert profile["of"] == "cpu" and len(profile["top"]) == 10 and all(t["us"] > 0 for t in profile["top"])
    assert (rows["docmask-26m-compiled"]["document_mask"], rows["muon-26m-compiled"]["optimizer"],
            rows["ac-104m-compiled"]["activation_checkpointing"]) == (True, "muon", True)
    assert figures["trainer"]["val_loss"] > 0  # --val-samples: validation ran
    assert figures["ddp1"]["backend"] == "gloo" and figures["ddp1"]["max_relative_difference"] <= 1e-3
    trainer_ddp = figures["trainer_ddp1"]  # the real Trainer, DDP-wrapped in a 1-rank gloo group, against itself plain
    assert trainer_ddp["backend"] == "gloo" and trainer_ddp["max_relative_difference"] <= 1e-3
    assert (trainer_ddp["runs"]["ddp"]["ddp"], trainer_ddp["runs"]["plain"]["ddp"]) == (True, False)
    assert trainer_ddp["group_collectives"] > 0 and trainer_ddp["runs"]["ddp"]["tokens_per_s"] > 0
    assert "x the plain Trainer's" in table["Trainer in a 1-rank group, DDP (NCCL; gloo on CPU), 26M"]["result"]
    # the MoE rows: CPU's "auto" is the split dispatch; the compiled row compiles the grouped one, without a break
    assert (rows["moe-26m-eager"]["moe_dispatch"], rows["moe-26m-compiled"]["moe_dispatch"]) == ("split", "grouped")
    assert rows["moe-26m-compiled"]["graph_breaks"] == 0 and rows["moe-26m-compiled"]["recompiles"] == 0
    assert figures["checkpoint"]["save_s"] > 0 and figures["checkpoint"]["restore_s"] > 0
    assert "of wall time at checkpoint_every 100" in table["checkpoint save + restore, 104M"]["result"]
    assert "written in the background" in table["checkpoint stall per save, sync vs async, 104M"]["result"]
    assert figures["ray_job"]["resumed"] and figures["ray_job"]["last_step"] == 8
    assert [h["steps_counted"] for h in figures["ray_job"]["halves"].values()] == [3, 3]  # records 1..4 and 5..8
    assert figures["fp16"]["passed"] and figures["fp16"]["scale_changes"][0] == {"step": 20, "from": 65536.0,
                                                                                 "to": 32768.0}
    assert figures["stream"]["tokens_per_s"] > 0 and figures["stream"]["to"] == "cpu" and figures["sample"]
    with tarfile.open(out / "gpu_check-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{p}.log" for p in PARTS} <= names and {f"results/{r}.json" for r in rows} <= names
    assert "check " in proc.stdout and "Ray Data stream delivery" in proc.stdout  # the table, printed


def test_stopped_check_keeps_its_results_and_kills_the_part(tmp_path):
    # SIGTERM (the shell script's `timeout`) in the middle of a part (a compilation, Inductor's caches off: seconds
    # long here): the part's process group is stopped, and the three result files are there, saying which part.
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--only", "step-26m-compiled"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    first = proc.stdout.readline()
    assert first.startswith("# GPU check on"), first
    assert proc.stdout.readline().startswith("[step-26m-compiled] -m bench.gpu_check row")
    deadline = time.monotonic() + 30
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.1)
    part = psutil.Process(proc.pid).children()
    assert part, "the part never started"
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, rest
    assert "stopped by SIGTERM during step-26m-compiled" in rest
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in part)
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["parts"]["step-26m-compiled"]["status"] == "stopped"
    assert result["finished"] == "stopped by SIGTERM during step-26m-compiled"
    assert "stopped by SIGTERM during step-26m-compiled" in (out / "gpu_check-summary.txt").read_text()
    with tarfile.open(out / "gpu_check-logs.tar.gz") as tar:
        assert "logs/step-26m-compiled.log" in tar.getnames()


def test_a_part_never_eats_the_time_kept_for_later_parts(tmp_path):
    runner = Runner(sys.executable, budget_s=60, work=tmp_path, env=dict(os.environ))
    runner.reserve_s = 58  # 2 s of the budget left to this part: it does not start
    part = runner.run("moe-26m-compiled", ["-c", "raise SystemExit(3)"], limit=30)
    assert (part.status, part.note) == ("skipped", "out of time (--budget; 58 s kept for the Ray parts)")
    runner.reserve_s = 0
    assert runner.run("prepare", ["-c", "raise SystemExit(3)"], limit=30).status == "failed"  # it does start


@pytest.mark.parametrize("where, says", [("missing", "no folder"), ("empty", "has no install.sh")])
def test_a_bad_bundle_is_one_error_line(tmp_path, where, says):
    folder = tmp_path / where
    if where == "empty":
        folder.mkdir()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--bundle", str(folder)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith("error: bench/gpu_check.sh: --bundle: ")
    assert says in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_unknown_part_is_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--only", "nope"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: --only: unknown part(s) nope; parts: ")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_table_without_ray():
    # A machine without ray: the Ray parts are SKIPPED rows that say what to install; the rest still report.
    why = "needs ray in this python: build the bundle ..."
    parts = {name: Part(name, "ok") for name in ("preflight", "step-26m-eager", "step-104m-eager", "step-26m-compiled",
                                                 "step-104m-compiled", "trainer")}
    parts["fp16"] = Part("fp16", "timeout", note="stopped at its 60 s limit")
    parts["moe-26m-compiled"] = Part("moe-26m-compiled", "stopped", note="stopped by a signal")
    parts.update({name: Part(name, "skipped", note=why) for name in ("prepare", "ray-job", "ray-job-resume",
                                                                     "export", "sample", "stream")})
    row = {"tokens_per_s": 1000.0, "mfu": 0.5, "mfu_datasheet": 0.46, "compile": False, "peak_memory_bytes": 2**30,
           "peak_memory_of": "torch.cuda.max_memory_allocated"}
    compiled = {**row, "compile": True, "compile_s": 31.0, "graph_breaks": 0, "recompiles": 1}
    figures = {"rows": {"step-26m-eager": row, "step-104m-eager": row, "step-26m-compiled": compiled,
                        "step-104m-compiled": {**compiled, "mfu_datasheet": 0.44}},
               "trainer": {"tokens_per_s": 960.0}}
    table = {r["check"]: r for r in table_rows(parts, figures, gpu=True)}
    assert table["step 26M bf16 compiled"]["status"] == "PASS"  # 46% of the data sheet >= 30%
    assert table["step 104M bf16 compiled"]["status"] == "BELOW GOAL"  # 44% < 45%
    assert table["step 26M bf16 compiled"]["result"] == (
        "1,000 tok/s, MFU 46.0% (of the measured matmul peak: 50.0%), peak memory 1.00 GiB "
        "(torch.cuda.max_memory_allocated), compile 31.0 s, 0 graph break(s), 1 recompile(s)")
    assert table["Trainer in-process (minilm.train), 26M"]["status"] == "BELOW GOAL"  # 0.96x < 0.97x
    for check in ("Ray job 1 worker, 26M, Train polling every 2 s", "  resumed with the job's 0.1 s polling",
                  "export + sample", "Ray Data stream delivery"):
        assert table[check]["status"] == "SKIPPED" and table[check]["result"] == why
    assert table["fp16 + GradScaler"]["status"] == "TIMEOUT"
    assert table["step 26M MoE 4x top-1 bf16 compiled"]["status"] == "STOPPED"
    assert table["step 26M MoE 4x top-1 bf16 eager"]["status"] == "SKIPPED"  # never started


# ---- the code paths that differ on torch 2.11 (the lent image's) ---------------------------------------------

@pytest.mark.parametrize("flag", ["forward_sync_buffers", "broadcast_buffers"])
def test_wrap_ddp_buffer_flag_by_torch_version(monkeypatch, flag):
    # torch 2.13 names DDP's per-forward buffer broadcast forward_sync_buffers; torch 2.11 (the lent image's) only
    # broadcast_buffers: wrap_ddp turns it off under whichever name this torch has (and asks for bucket views).
    from minilm import trainer

    seen = {}

    def fake_init(self, module, device_ids=None, **kwargs):
        seen.update(kwargs)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("module", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("device_ids", inspect.Parameter.KEYWORD_ONLY, default=None),
              inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, default=True)]
    fake_init.__signature__ = inspect.Signature(params)
    fake = type("FakeDDP", (), {"__init__": fake_init})
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", fake)
    trainer.wrap_ddp(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert seen == {flag: False, "gradient_as_bucket_view": True}
