"""The package as pip builds it: what the wheel and the sdist hold (minilm and ray_jobs, no bench; the LICENSE; no
tests in the sdist), the `minilm` command and its subcommands, the extras, and the Ray pin the cluster files share."""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest
import yaml
from helpers import ROOT, run_module

from ray_jobs.__main__ import COMMANDS

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[zipfile.ZipFile, tarfile.TarFile]:
    """The wheel and the sdist, built offline (setuptools' own backend) from a copy of the checkout's files, so that
    nothing (build/, *.egg-info) is written into the checkout."""
    tmp = tmp_path_factory.mktemp("dist")
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in names:
        if name and (ROOT / name).is_file():
            (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp / "src" / name)
    for hook in ("build_sdist", "build_wheel"):  # a process each, as a build frontend calls them
        proc = subprocess.run([sys.executable, "-c", f"import sys, setuptools.build_meta as b; b.{hook}(sys.argv[1])",
                               str(tmp / "out")], cwd=tmp / "src", capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return zipfile.ZipFile(next((tmp / "out").glob("*.whl"))), tarfile.open(next((tmp / "out").glob("*.tar.gz")))


def test_the_wheel_installs_minilm_and_ray_jobs_only_and_neither_imports_bench(dists):
    wheel, _ = dists
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"minilm", "ray_jobs"}
    for name in (n for n in names if n.endswith(".py")):
        source = wheel.read(name).decode()
        assert not re.search(r"^\s*(from|import)\s+bench\b", source, re.M), name
        if name.startswith("minilm/"):  # ray_jobs imports minilm, never the other way round
            assert not re.search(r"^\s*(from|import)\s+ray_jobs\b", source, re.M), name


def test_the_license_is_in_the_wheel_and_the_sdist(dists):
    wheel, sdist = dists
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert wheel.read("minilm-0.1.0.dist-info/licenses/LICENSE").decode() == text
    assert sdist.extractfile("minilm-0.1.0/LICENSE").read().decode() == text
    assert "License-Expression: Apache-2.0" in wheel.read("minilm-0.1.0.dist-info/METADATA").decode()


def test_the_sdist_leaves_tests_and_bench_out(dists):
    _, sdist = dists
    names = sdist.getnames()
    assert "minilm-0.1.0/pyproject.toml" in names and "minilm-0.1.0/ray_jobs/__main__.py" in names
    assert not [n for n in names if n.split("/")[1:2] in (["tests"], ["bench"])]


def test_the_minilm_console_command_is_the_dispatcher(dists):
    wheel, _ = dists
    entry = configparser.ConfigParser()
    entry.read_string(wheel.read("minilm-0.1.0.dist-info/entry_points.txt").decode())
    assert dict(entry["console_scripts"]) == {"minilm": "ray_jobs.__main__:main"}


def test_every_subcommand_runs_its_modules_main():
    """The modules `python -m MODULE` runs: each defines the main(argv) the dispatcher calls."""
    assert list(COMMANDS) == ["prepare", "pretrain", "tune", "export", "evaluate", "sample", "plot", "train",
                              "demo-tasks"]
    for module, _ in COMMANDS.values():
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        mains = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main"]
        assert mains and mains[0].args.args[0].arg == "argv", module


def test_help_lists_each_subcommand_on_one_line():
    proc = run_module("ray_jobs", ["--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    for name, (_, text) in COMMANDS.items():
        assert re.search(rf"^  {re.escape(name)} +{re.escape(text)}$", proc.stdout, re.M), name


def test_a_subcommands_help_is_its_own():
    proc = run_module("ray_jobs", ["sample", "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m minilm.sample") and "--checkpoint" in proc.stdout


@pytest.mark.parametrize("args", [["bogus"], []])
def test_an_unknown_or_missing_subcommand_is_one_error_line_and_exit_2(args):
    proc = run_module("ray_jobs", args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1] == "see: minilm --help", lines
    assert "bogus" in lines[0] if args else "COMMAND" in lines[0]


def test_the_all_extra_holds_every_user_facing_extra_and_not_dev():
    extras = PYPROJECT["project"]["optional-dependencies"]
    seen, todo = set(), ["all"]
    while todo:
        for req in extras[todo.pop()]:
            for name in re.findall(r"^minilm\[([^\]]+)\]$", req)[0].split(",") if req.startswith("minilm[") else ():
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
    assert seen == set(extras) - {"dev", "all"}


def test_the_ray_pin_is_the_cluster_files_version():
    pins = [re.fullmatch(r"ray\[[a-z,]+\]==(\d+\.\d+\.\d+)", d) for d in PYPROJECT["project"]["dependencies"]]
    (pin,) = [m[1] for m in pins if m]
    cluster = ROOT / "cluster"
    versions = set(re.findall(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)-", (cluster / "Dockerfile").read_text(), re.M))
    aws = yaml.safe_load((cluster / "aws.yaml").read_text())["docker"]
    versions.update(re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-.*", aws[k])[1] for k in ("head_image", "worker_image"))
    for manifest in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        versions.update(re.findall(r'rayVersion: "(\d+\.\d+\.\d+)"', (cluster / manifest).read_text()))
    from bench.gpu_bundle import RAY_VERSION
    assert versions | {RAY_VERSION} == {pin}
