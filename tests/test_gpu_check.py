"""bench/gpu_check.sh off a GPU: the rehearsal of the lent machine (a clean venv of the image's packages at the
image's versions where this python can take them, no Ray, the bundle installed by its own line, empty compiler and
pip caches, then the CPU dry run), the plan (in order of value, within 80% of the budget, re-planned after a slow
cold start), the gates, the results it leaves under $OUT when stopped, the table without Ray, and the code paths
that differ on the lent image's torch 2.11."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import ROOT, error_lines, run_module, wait_for

from bench import gpu_check as G
from bench import gpu_plan as P
from bench.gpu_bundle import canonical, image_packages, image_versions
from bench.gpu_check import Runner
from bench.gpu_plan import FILES, SPECS, Part, make_plan
from bench.gpu_table import table_rows

PARTS = [spec.name for spec in SPECS]  # every part, in the plan's order
# No CPU build of the image's torch 2.11 is on PyPI (its Linux wheel is the CUDA 13.0 build: 530 MB, and GBs of
# CUDA wheels it requires), and triton comes with a CUDA torch: the rehearsal keeps this machine's torch 2.13 CPU.
NOT_FROM_PYPI = {"torch", "triton"}


def image_venv(dest: Path) -> tuple[Path, dict[str, str]]:
    """A venv holding only what the lent image holds: every package of this project's venv that the image's list
    names (torch 2.13 CPU, numpy, pyarrow, tokenizers, pyyaml, safetensors, pip, ...), linked in, no Ray; where the
    image's version is known and differs, that version from PyPI instead if this python has a wheel of it. Returns
    the python and {package: "this version (image's: that one)"} for what still differs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = next(dest.glob("lib/python*/site-packages"))
    image, differ, installed = image_packages(), {}, set()
    for name, version in image_versions().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            continue
        wheels = dest / "wheels" / name
        if have == version or (name not in NOT_FROM_PYPI and subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
                 "-d", str(wheels), f"{name}=={version}"], capture_output=True, env=bare_env()).returncode == 0):
            if have != version:
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                                "--no-compile", "--target", str(site), *map(str, wheels.glob("*.whl"))],
                               check=True, env=bare_env())
                installed.add(canonical(name))
        else:
            differ[name] = f"{have} (image's: {version})"
    for dist in md.distributions():
        if canonical(dist.metadata["Name"]) not in image or canonical(dist.metadata["Name"]) in installed:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    differ["python"] = f"{sys.version.split()[0]} (image's: 3.12.3; the torch here is built for this one)"
    return dest / "bin" / "python", differ


def bare_env(**extra: str) -> dict:
    """This environment without the venv, the pip settings and any Ray, PYTHONPATH or compiler cache settings: as on
    the lent machine."""
    drop = ("PIP_", "RAY_", "VIRTUAL_ENV", "PYTHONPATH", "MINILM_BENCH_RESULTS", "OUT", "TORCHINDUCTOR_", "TRITON_")
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


@pytest.mark.nightly  # ~5.5 min from its cold caches: run it before a lent GPU session (make test-nightly)
@pytest.mark.ray
def test_rehearsal_on_the_image_packages_and_the_bundle(gpu_bundle, tmp_path):
    # The proof that the GPU run lacks nothing: bench/gpu_check.sh --bundle in a venv of the image's packages, Ray
    # and its missing needs only from the bundle, from a cold start (empty Inductor, Triton and pip caches), every
    # part of the dry run ok and none left out of the plan. Its own local Ray (one for all the Ray parts, on
    # 127.0.0.1, a fixed object store), so this test never joins the session's.
    manifest = json.loads((gpu_bundle / "bundle.json").read_text())
    assert manifest["total_bytes"] < 60 * 2**20
    python, differ = image_venv(tmp_path / "venv")
    print(f"rehearsal: versions that differ from the image's: {differ}")
    no_ray = subprocess.run([python, "-c", "import ray"], capture_output=True, text=True, env=bare_env())
    assert no_ray.returncode == 1 and "No module named 'ray'" in no_ray.stderr
    out, site, cache = tmp_path / "out", tmp_path / "site", tmp_path / "cache"
    env = bare_env(PYTHON=str(python), OUT=str(out), MINILM_BUNDLE_SITE=str(site), PIP_NO_CACHE_DIR="1",
                   TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--bundle", str(gpu_bundle)],
                          env=env, capture_output=True, text=True, timeout=2500)
    print(f"rehearsal: {time.monotonic() - t0:.0f} s; " + ", ".join(
        " ".join(m.groups()) for m in re.finditer(r"^\[([\w-]+)\] \w+ in (\d+) s", proc.stdout, re.M)))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert (site / "ray" / "__init__.py").is_file() and not (site / "ray" / "jars").exists()
    assert any((cache / "inductor").iterdir())  # compiled from the empty cache it was given
    # The plan first: every part, in order, within 80% of the budget
    lines = proc.stdout.splitlines()
    first_part = next(i for i, line in enumerate(lines) if line.startswith("[preflight]"))
    total = next(line for line in lines[:first_part] if line.startswith("total "))
    used, budget = (float(x) for x in re.fullmatch(r"total (\d+) s of (\d+) s", total).groups())
    assert used <= 0.8 * budget
    assert sorted(p.name for p in out.rglob("*")) == sorted(FILES)  # 3 files, no folder: within the 8 that return
    result = json.loads((out / "gpu_check.json").read_text())
    assert [name for name, _ in result["plan"]["parts"]] == PARTS and result["plan"]["left"] == []
    assert {name: part["status"] for name, part in result["parts"].items()} == dict.fromkeys(["bundle", *PARTS], "ok")
    assert all(part["wall_s"] <= part["limit_s"] for name, part in result["parts"].items() if name != "bundle")
    assert result["finished"] == "finished"
    table = {row["check"]: row for row in result["table"]}
    assert table["step 104M bf16 compiled"]["goal"] == ">= 45% MFU"
    assert {row["status"] for row in table.values()} == {"dry run"}  # the CPU run's figures are for no goal
    assert table["preflight"]["result"].startswith(f"torch {torch.__version__}") and "ray 2.60.0" in table["preflight"]["result"]
    figures = result["figures"]
    pre = figures["preflight"]
    assert pre["gates"] == {"ray": None, "compile": None} and "compile_s" not in pre  # CUDA's
    assert pre["phases_s"]["process_start"] > 0 and pre["phases_s"]["import_ray"] > 0
    assert figures["ray"]["node_ip"] == "127.0.0.1" and figures["ray"]["object_store_bytes"] == G.CPU.object_store_bytes
    assert figures["ray"]["memory_monitor_refresh_ms"] == "0"
    rows = figures["rows"]
    assert set(rows) == {p for p in PARTS if p.endswith(("-eager", "-compiled"))}
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0, name
        assert (row["compile_s"] is not None) == name.endswith("-compiled"), name
        assert f"[{name}] row: {row['tokens_per_s']:,.0f} tok/s" in proc.stdout  # printed as it was measured
        # SDPA's kernel at the row's own shape: its head dim, GQA (8 query, 4 KV heads) and mask
        assert row["sdpa"]["kernel"] in ("flash (CPU)", "math") and row["sdpa"]["seq"] == G.CPU.small["seq_len"], name
        assert (row["sdpa"]["heads"], row["sdpa"]["kv_heads"], row["sdpa"]["document_mask"]) == (
            8, 4, name.startswith("docmask")), name
    assert rows["step-26m-compiled"]["graph_breaks"] == 0 and rows["step-26m-compiled"]["recompiles"] == 0
    # the headline rows compile the whole model (its loss inside), the other compiled rows each block
    assert {n: r["compile"] for n, r in rows.items() if n.startswith("step-") and n.endswith("-compiled")} == {
        "step-26m-compiled": "model", "step-104m-compiled": "model"}
    assert rows["moe-26m-compiled"]["compile"] == "blocks"
    profile = rows["step-26m-compiled"]["profile"]  # one profiled step: its top ops (CPU here)
    assert profile["of"] == "cpu" and len(profile["top"]) == 10 and all(t["us"] > 0 for t in profile["top"])
    assert (rows["docmask-26m-compiled"]["document_mask"], rows["muon-26m-compiled"]["optimizer"],
            rows["ac-104m-compiled"]["activation_checkpointing"]) == (True, "muon", True)
    trainer_ddp = figures["trainer_ddp1"]  # the real Trainer, DDP-wrapped in a 1-rank gloo group, against itself plain
    assert trainer_ddp["backend"] == "gloo" and trainer_ddp["max_relative_difference"] <= 1e-3
    assert (trainer_ddp["runs"]["ddp"]["ddp"], trainer_ddp["runs"]["plain"]["ddp"]) == (True, False)
    assert trainer_ddp["group_collectives"] > 0 and trainer_ddp["runs"]["ddp"]["tokens_per_s"] > 0
    assert "x the plain Trainer's" in table["Trainer in a 1-rank group, DDP (NCCL; gloo on CPU), 26M"]["result"]
    # the MoE rows: CPU's "auto" is the split dispatch; the compiled row compiles the grouped one, without a break
    assert (rows["moe-26m-eager"]["moe_dispatch"], rows["moe-26m-compiled"]["moe_dispatch"]) == ("split", "grouped")
    assert rows["moe-26m-compiled"]["graph_breaks"] == 0 and rows["moe-26m-compiled"]["recompiles"] == 0
    stall = table["checkpoint stall per save, sync vs async, 104M"]["result"]
    assert "written in the background" in stall and "of wall time at checkpoint_every 100" in stall
    assert figures["ray_job"]["resumed"] and figures["ray_job"]["last_step"] == 8
    assert [h["steps_counted"] for h in figures["ray_job"]["halves"].values()] == [3, 3]  # records 1..4 and 5..8
    assert "% of step time" in table["Ray job data wait (its Ray Data stream)"]["result"]
    with tarfile.open(out / "gpu_check-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{p}.log" for p in PARTS} <= names and {f"results/{r}.json" for r in rows} <= names
    assert "check " in proc.stdout and "Ray job data wait" in proc.stdout  # the table, printed


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
    plan = [proc.stdout.readline() for _ in range(4)]
    assert plan[-1].startswith("total ") and proc.stdout.readline().startswith("[step-26m-compiled] -m bench.gpu_check row")
    wait_for(lambda: psutil.Process(proc.pid).children(), proc, "the part to start", timeout=30)
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


def test_a_part_never_runs_past_its_limit_or_the_budget(tmp_path):
    runner = Runner(sys.executable, budget_s=60, work=tmp_path, env=dict(os.environ))
    runner.limits.update({"export": 1, "prepare": 30})
    part = runner.run("export", ["-c", "import time; time.sleep(30)"])
    assert (part.status, part.note) == ("timeout", "stopped at its 1 s limit") and part.wall_s < 10
    runner.deadline = time.monotonic() + 2  # 2 s of the budget left: the part does not start
    assert runner.run("prepare", ["-c", "raise SystemExit(3)"]).note == "out of time (--budget)"


# ---- the plan --------------------------------------------------------------------------------------------------

HEADLINE = ["step-104m-compiled", "step-26m-compiled"]
NEVER_RUN = ["trainer-ddp1-26m", "moe-26m-compiled", "checkpoint-stall-104m", "ray-job", "ray-job-resume"]
REFINEMENTS = ["docmask-26m-compiled", "muon-26m-compiled", "ac-104m-compiled", "step-104m-eager", "moe-26m-eager"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_plan_fits_the_budget_with_a_fifth_to_spare(device):
    plan = make_plan(device, G.BUDGET[device])
    assert plan.total <= 0.8 * G.BUDGET[device] and plan.parts[0][0] == "preflight"
    assert [n for n, _ in plan.parts] == [n for n in PARTS if n not in dict(plan.left)]  # in the order of value
    assert [n for n, _ in plan.left] == [n for n in PARTS if n not in dict(plan.parts)]  # the rest, in order
    if device == "cpu":
        assert plan.left == []  # the dry run runs every part
    # the lent GPU: one command of 600 s, the bundle's install and the results inside it
    assert device == "cpu" or P.BUDGET["cuda"] + P.INSTALL_S + P.RESULTS_S <= P.COMMAND_S <= P.DEVICE_S - P.MACHINE_START_S


def test_the_headline_rows_come_first_then_the_parts_never_run_on_a_gpu():
    plan = make_plan("cuda", G.BUDGET["cuda"])
    planned = [n for n, _ in plan.parts]
    assert planned[:3] == ["preflight", *HEADLINE]  # both in the first call, whatever else fits
    assert max(PARTS.index(n) for n in NEVER_RUN) < min(PARTS.index(n) for n in REFINEMENTS)
    # a part kept only for its users is not planned without one: prepare and the Ray start go with the Ray job
    assert ("prepare" in planned) == ("ray-job" in planned)
    assert ("ray-start" in planned) == ("prepare" in planned)
    # the first compiled part of a block graph pays the compilation, a later one reads Inductor's cache
    everything = dict(make_plan("cuda", 10_000).parts)
    assert everything["step-26m-compiled"] > everything["muon-26m-compiled"]
    # a budget too small for anything else still plans the headline rows
    assert [n for n, _ in make_plan("cuda", 100).parts] == ["preflight", *HEADLINE]


def test_plan_prints_alone_and_ends_with_its_total():
    proc = run_module("bench.gpu_check", ["--plan"], env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    plan = make_plan("cuda", G.BUDGET["cuda"])
    assert lines[-1] == f"total {plan.total:.0f} s of {G.BUDGET['cuda']} s"
    first_call = [line.split()[1] for line in lines if re.match(r"\s+\d+\. ", line)]
    assert first_call == [n for n, _ in plan.parts] and set(HEADLINE) <= set(first_call)
    assert any(line.startswith("  then, each as the time left allows: ") and "ray-job 55 s" in line for line in lines)


def test_only_adds_what_the_named_parts_need():
    plan = make_plan("cpu", G.BUDGET["cpu"], only={"ray-job-resume", "step-26m-eager"})
    assert [n for n, _ in plan.parts] == ["step-26m-eager", "ray-start", "prepare", "ray-job", "ray-job-resume"]
    assert plan.added == ["prepare", "ray-job", "ray-start"]


def rehearse(tmp_path, monkeypatch, device: str, budget: float, took, preflight=None):
    """The check's loop with every part a stand-in on a fake clock (no process, no sleep): part `name` takes
    took(name, limit) seconds, capped at its limit and the time left; `preflight(c)` may close gates. Returns the
    parts in the order they ran, the runner and the plan."""
    now, ran = [0.0], []  # the fake clock's time

    def fake(c, name):
        seconds = min(took(name, c.r.limits[name]), c.r.limits[name], c.r.left())
        now[0] += seconds
        ran.append(name)
        c.r.parts[name] = Part(name, "ok", wall_s=seconds)
        if name == "preflight" and preflight:
            preflight(c)

    monkeypatch.setattr(G, "PART_RUNS", {n: (lambda c, n=n: fake(c, n)) for n in PARTS})
    runner = Runner(sys.executable, budget_s=budget, work=tmp_path, env={}, clock=lambda: now[0])
    plan = make_plan(device, budget)
    G.run_parts(G.Check(runner, G.GPU if device == "cuda" else G.CPU, device, tmp_path, {}), plan)
    assert now[0] <= budget + 1e-9  # never past the budget
    return ran, runner, plan


def test_time_the_parts_leave_runs_the_parts_left(tmp_path, monkeypatch):
    # Every part takes a third of its limit: the time the first call's parts leave starts the parts the plan could
    # not promise, in order of value, each when its limit fits what is actually left.
    ran, runner, plan = rehearse(tmp_path, monkeypatch, "cuda", G.BUDGET["cuda"], lambda n, limit: limit / 3)
    assert plan.left and {n for n, _ in plan.parts} <= set(ran)
    pulled = [n for n, _ in plan.left if n in ran]
    assert {"ray-start", "prepare", "ray-job", "ray-job-resume"} <= set(pulled)  # pulled forward
    assert ran == [n for n in PARTS if n in ran]  # in the order of value
    for name in (n for n, _ in plan.left if n not in ran):
        assert runner.parts[name].status == "left" and runner.parts[name].note.startswith("left for a rerun (")


@pytest.mark.parametrize("budget", [G.BUDGET["cuda"], 220])
def test_a_slow_preflight_still_runs_both_headline_rows(tmp_path, monkeypatch, budget):
    # The preflight took its whole limit, 1.5x the cold start assumed, and every part its whole limit: every later
    # limit grows 1.5x, the least valuable parts are left (never failed), the headline rows run even where their
    # limits no longer fit, and no part runs whose users were all left.
    ran, runner, plan = rehearse(tmp_path, monkeypatch, "cuda", budget, lambda n, limit: limit)
    assert plan.scale == 1.5 and ran[:3] == ["preflight", *HEADLINE]
    assert all(runner.parts[n].status == "ok" for n in HEADLINE)
    left = [n for n, p in runner.parts.items() if p.status == "left"]
    assert left and left == [n for n in PARTS if n in left] and PARTS.index(left[-1]) == len(PARTS) - 1
    for name in ran:  # a part others need ran only with one of them after it
        needed_by = P.users(name, PARTS)
        assert not needed_by or any(n in ran for n in needed_by), name
    unscaled = dict(make_plan("cuda", 10_000).parts)
    assert all(runner.limits[n] >= 1.5 * unscaled[n] - 5 for n in ran[1:])
    if budget < G.BUDGET["cuda"]:
        assert ran == ["preflight", *HEADLINE]  # the 26M row ran in less than its limit, the rest left
        assert runner.parts["step-26m-compiled"].wall_s < runner.limits["step-26m-compiled"]


@pytest.mark.parametrize("gate", ["ray", "compile"])
def test_a_closed_gate_skips_only_what_is_behind_it(tmp_path, monkeypatch, gate):
    def preflight(c):
        c.gates[gate] = "import ray.train.torch, ray.data: ModuleNotFoundError" if gate == "ray" else "no compiler"

    ran, runner, _ = rehearse(tmp_path, monkeypatch, "cpu", 10_000, lambda n, limit: 1, preflight)
    skipped = {n for n, p in runner.parts.items() if p.status == "skipped"}
    if gate == "ray":  # and what needs their results
        assert skipped == {"ray-start", "prepare", "ray-job", "ray-job-resume"}
    else:
        assert skipped == {n for n in G.ROWS if n.endswith("-compiled")}
        assert "trainer-ddp1-26m" in ran  # it runs, eager
    assert set(ran) | skipped == set(PARTS) and all(runner.parts[n].status == "ok" for n in ran)


@pytest.mark.parametrize("where, says", [("missing", "no folder"), ("empty", "has no install.sh"),
                                         ("failing", "installing the bundle")])
def test_a_bad_bundle_is_one_error_line_and_a_result_file(tmp_path, where, says):
    # A bundle missing or failing to install: one error line, then the check runs the parts that need no bundle,
    # skips the Ray parts saying why, and writes its result files with the bundle's failure in them.
    folder, out = tmp_path / where, tmp_path / "out"
    if where != "missing":
        folder.mkdir()
    if where == "failing":
        (folder / "install.sh").write_text("false\n")
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "MINILM_COMMAND_S": "120"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--bundle", str(folder),
                           "--only", "prepare"], capture_output=True, text=True, timeout=120, env=env)
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: bench/gpu_check.sh: ") and says in errors[0]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["parts"]["bundle"]["status"] == "failed" and says in result["parts"]["bundle"]["note"]
    assert result["parts"]["prepare"]["status"] == "skipped" and "the bundle did not install" in (
        result["parts"]["prepare"]["note"])
    table = {row["check"]: row for row in result["table"]}
    assert table["bundle install (Ray and what it needs)"]["status"] == "FAILED"
    assert "bundle" in (out / "gpu_check-summary.txt").read_text()


def test_unknown_part_is_one_error_line():
    proc = run_module("bench.gpu_check", ["--device", "cpu", "--only", "nope"],
                      env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: --only: unknown part(s) nope; parts: ")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_table_without_ray():
    # A machine without ray: the Ray parts are SKIPPED rows that say what to install; the rest still report.
    why = "needs ray in this python: build the bundle ..."
    parts = {name: Part(name, "ok") for name in ("preflight", "step-26m-eager", "step-104m-eager", "step-26m-compiled",
                                                 "step-104m-compiled", "trainer-ddp1-26m")}
    parts["checkpoint-stall-104m"] = Part("checkpoint-stall-104m", "timeout", note="stopped at its 35 s limit")
    parts["moe-26m-compiled"] = Part("moe-26m-compiled", "stopped", note="stopped by a signal")
    parts.update({name: Part(name, "skipped", note=why) for name in ("prepare", "ray-job", "ray-job-resume")})
    parts["ac-104m-compiled"] = Part("ac-104m-compiled", "left", note="left for a rerun (its 70 s limit did not fit)")
    row = {"tokens_per_s": 1000.0, "mfu": 0.5, "mfu_datasheet": 0.46, "compile": "off", "peak_memory_bytes": 2**30,
           "peak_memory_of": "torch.cuda.max_memory_allocated"}
    compiled = {**row, "compile": "model", "compile_s": 31.0, "graph_breaks": 0, "recompiles": 1}
    figures = {"rows": {"step-26m-eager": row, "step-104m-eager": row, "step-26m-compiled": compiled,
                        "step-104m-compiled": {**compiled, "mfu_datasheet": 0.44}},
               "trainer_ddp1": {"runs": {"plain": {"tokens_per_s": 960.0}, "ddp": {"tokens_per_s": 950.0}},
                                "backend": "nccl", "compile": True, "ddp_over_plain": 0.99,
                                "max_relative_difference": 0.0}}
    table = {r["check"]: r for r in table_rows(parts, figures, gpu=True)}
    assert table["step 26M bf16 compiled"]["status"] == "PASS"  # 46% of the data sheet >= 30%
    assert table["step 104M bf16 compiled"]["status"] == "BELOW GOAL"  # 44% < 45%
    assert table["step 26M bf16 compiled"]["result"] == (
        "1,000 tok/s, MFU 46.0% (of the measured matmul peak: 50.0%), peak memory 1.00 GiB "
        "(torch.cuda.max_memory_allocated), compile (model) 31.0 s, 0 graph break(s), 1 recompile(s)")
    assert table["Trainer in-process (trainer-ddp1's plain run), 26M"]["status"] == "BELOW GOAL"  # 0.96x < 0.97x
    for check in ("Ray job 1 worker, 26M, to half its steps", "  resumed to the end",
                  "Ray job data wait (its Ray Data stream)"):
        assert table[check]["status"] == "SKIPPED" and table[check]["result"] == why
    assert table["step 104M activation checkpointing compiled"]["status"] == "LEFT"
    assert table["checkpoint stall per save, sync vs async, 104M"]["status"] == "TIMEOUT"
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

    Param = inspect.Parameter
    fake_init.__signature__ = inspect.Signature([
        Param("self", Param.POSITIONAL_OR_KEYWORD), Param("module", Param.POSITIONAL_OR_KEYWORD),
        Param("device_ids", Param.KEYWORD_ONLY, default=None), Param(flag, Param.KEYWORD_ONLY, default=True)])
    fake = type("FakeDDP", (), {"__init__": fake_init})
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", fake)
    trainer.wrap_ddp(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert seen == {flag: False, "gradient_as_bucket_view": True}
