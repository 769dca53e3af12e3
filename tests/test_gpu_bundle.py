"""bench/gpu_bundle.py: the Ray wheel rewritten without the parts the GPU check never loads stays a valid wheel,
and the bundle's install line installs it. (The whole bundle, built and used for the check's dry run in a clean
venv: tests/test_bench_smoke.py's rehearsal.)"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.gpu_bundle import INSTALL_SH, BundleError, main, slim_wheel


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


FILES = {"demo/__init__.py": b"VALUE = 42\n", "demo/jars/big.jar": b"\0" * 5000, "demo/web/app.js": b"x" * 3000,
         "demo/web/deep/map.js": b"y" * 100, "demo/core/raylet": b"binary" * 10}


def make_wheel(folder: Path, files: dict[str, bytes], unlisted: tuple[str, ...] = ()) -> Path:
    path = folder / "demo-1.0-py3-none-any.whl"
    meta = {"demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
            "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    members = {**files, **meta}
    rows = [[name, record_hash(data), str(len(data))] for name, data in members.items() if name not in unlisted]
    rows.append(["demo-1.0.dist-info/RECORD", "", ""])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("demo-1.0.dist-info/RECORD", text.getvalue())
    return path


def test_slim_wheel_drops_the_prefixes_and_keeps_record_exact(tmp_path):
    wheel = make_wheel(tmp_path, FILES)
    info = slim_wheel(wheel, ("demo/jars/", "demo/web/"))
    assert info["removed_files"] == 3 and info["bytes_after"] < info["bytes_before"]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        rows = list(csv.reader(io.StringIO(z.read("demo-1.0.dist-info/RECORD").decode())))
        assert names == {"demo/__init__.py", "demo/core/raylet", "demo-1.0.dist-info/METADATA",
                         "demo-1.0.dist-info/WHEEL", "demo-1.0.dist-info/RECORD"}
        assert {row[0] for row in rows} == names  # RECORD lists exactly what is in the wheel
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                assert digest == size == ""
            else:
                assert digest == record_hash(z.read(name)) and int(size) == len(z.read(name))
    # and pip installs it the bundle's way (no index, no deps, into a folder)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), str(wheel)], check=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert (target / "demo" / "__init__.py").read_bytes() == FILES["demo/__init__.py"]
    assert not (target / "demo" / "jars").exists() and not (target / "demo" / "web").exists()


def test_slim_wheel_refuses_a_member_its_record_does_not_list(tmp_path):
    wheel = make_wheel(tmp_path, FILES, unlisted=("demo/core/raylet",))
    with pytest.raises(BundleError, match="demo/core/raylet is not in its RECORD"):
        slim_wheel(wheel, ("demo/jars/",))


def test_install_line_is_the_machines(tmp_path):
    # The device page's line: pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
    # /tmp/site WHEELS && export PYTHONPATH=/tmp/site (the folder overridable here, for the rehearsal).
    text = INSTALL_SH.format(name="gpu-bundle")
    assert ("-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\\n"
            '    --target "$_minilm_site" "$_minilm_bundle"/*.whl && export PYTHONPATH="$_minilm_site') in text
    assert '"${MINILM_BUNDLE_SITE:-/tmp/site}"' in text


def test_bad_python_version_is_one_error_line(capsys, tmp_path):
    assert main(["--python-version", "312", "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err == "error: bench/gpu_bundle.sh: --python-version must look like 3.12, got '312'\n"
