"""The bundle for the lent GPU machine: wheels of what the GPU check needs that the machine's image lacks.

    bash bench/gpu_bundle.sh                                   # cp312 (the image's python) into gpu-bundle/
    make gpu-bundle                                            # that, then --verify gpu-bundle

The machine reaches no package registry and takes at most 64 MiB of working tree a call: the requirements of
`ray[train,tune,data]`, resolved for the target python, less what the image holds (bench/gpu_image_packages.txt),
as wheels, Ray's slimmed (`SLIM_PREFIXES`); `install.sh` installs them (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
RAY_VERSION = "2.60.0"  # this project's pin (pyproject: ray[...]==2.60.0; tests/test_package.py)
REQUIREMENTS = ("ray[train,tune,data]=={ray}",)
# Parts of Ray's wheel that the check never loads: Java workers (no JVM there), the dashboard's web page (the
# check starts no dashboard; its API needs none of these files).
SLIM_PREFIXES = ("ray/jars/", "ray/dashboard/client/build/")
# The platform tags of the machine's rules (x86-64, glibc 2.28 and older wheels).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
LIMIT_MIB = 60.0
INSTALL_SH = """\
# The lent machine's install line for this bundle (its rules: wheels, no index, no deps, into one folder on
# PYTHONPATH). Source it from bash: `. {name}/install.sh` (bench/gpu_check.sh --bundle {name} does).
_minilm_bundle="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
_minilm_site="${{MINILM_BUNDLE_SITE:-/tmp/site}}"
"${{PYTHON:-python3}}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target "$_minilm_site" "$_minilm_bundle"/*.whl && export PYTHONPATH="$_minilm_site${{PYTHONPATH:+:$PYTHONPATH}}"
"""


class BundleError(Exception):
    pass


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    words = [w for line in path.read_text().splitlines() if not line.startswith("#") for w in line.split()]
    return {canonical(w) for w in words}


def image_versions(path: Path = IMAGE_PACKAGES) -> dict[str, str]:
    """The image's versions where they are known (the list's `# versions:` line): {name: version}."""
    lines = [line.split(":", 1)[1] for line in path.read_text().splitlines() if line.startswith("# versions:")]
    return dict(word.split("==", 1) for line in lines for word in line.split())


def pip_target_flags(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[x for p in PLATFORMS for x in ("--platform", p)]]


def resolve(requirements: list[str], python_version: str) -> list[tuple[str, str]]:
    """(name, version) of everything pip would install for `requirements` on the target python, from a dry run's
    report (metadata only: nothing is downloaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
               str(report), "--target", str(Path(tmp) / "target"), *pip_target_flags(python_version), *requirements]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BundleError(f"pip could not resolve {' '.join(requirements)} for cp{python_version}: "
                              f"{last_error(proc.stderr)}")
        items = json.loads(report.read_text())["install"]
    return [(item["metadata"]["name"], item["metadata"]["version"]) for item in items]


def last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("WARNING")]
    return lines[-1].strip() if lines else "(no message)"


def download(pins: list[tuple[str, str]], python_version: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *pip_target_flags(python_version),
           "-d", str(out), *[f"{name}=={version}" for name, version in pins]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip download failed: {last_error(proc.stderr)}")


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_wheel(path: Path, prefixes: tuple[str, ...]) -> dict:
    """Rewrite the wheel at `path` without its members under `prefixes`, RECORD rewritten to list exactly what is
    left (each line's hash and size checked against the member): still a valid wheel of the same name."""
    with zipfile.ZipFile(path) as src:
        names = src.namelist()
        record_name = next((n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1), None)
        if record_name is None:
            raise BundleError(f"{path.name}: not a wheel (no .dist-info/RECORD)")
        dropped = [n for n in names if n.startswith(prefixes)]
        rows = list(csv.reader(io.StringIO(src.read(record_name).decode())))
        kept_rows = [row for row in rows if row and not row[0].startswith(prefixes)]
        listed = {row[0] for row in kept_rows}
        tmp = path.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
            for info in src.infolist():
                if info.filename in dropped or info.filename == record_name:
                    continue
                if info.filename not in listed and not info.filename.endswith("/"):
                    raise BundleError(f"{path.name}: {info.filename} is not in its RECORD")
                dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(kept_rows)
            dst.writestr(record_name, text.getvalue())
    before = path.stat().st_size
    tmp.replace(path)
    return {"wheel": path.name, "removed_prefixes": list(prefixes), "removed_files": len(dropped),
            "bytes_before": before, "bytes_after": path.stat().st_size}


def build(python_version: str, out: Path, *, limit_mib: float = LIMIT_MIB) -> dict:
    if not re.fullmatch(r"3\.\d+", python_version):
        raise BundleError(f"--python-version must look like 3.12, got {python_version!r}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    requirements = [r.format(ray=RAY_VERSION) for r in REQUIREMENTS]
    image = image_packages()
    resolved = resolve(requirements, python_version)
    carried = [(n, v) for n, v in resolved if canonical(n) not in image]
    download(carried, python_version, out)
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != len(carried):
        raise BundleError(f"expected {len(carried)} wheels in {out}, found {len(wheels)}")
    ray_wheels = [w for w in wheels if w.name.startswith("ray-")]
    slimmed = [slim_wheel(w, SLIM_PREFIXES) for w in ray_wheels]
    (out / "install.sh").write_text(INSTALL_SH.format(name=out.name))
    sizes = {w.name: w.stat().st_size for w in wheels}
    total = sum(sizes.values()) + (out / "install.sh").stat().st_size
    manifest = {"python_version": python_version, "requirements": requirements,
                "image_packages": str(IMAGE_PACKAGES.relative_to(ROOT)),
                "from_image": sorted(f"{n}=={v}" for n, v in resolved if canonical(n) in image),
                "wheels": sizes, "slimmed": slimmed, "total_bytes": total}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if total > limit_mib * 2**20:
        raise BundleError(f"the bundle in {out} is {total / 2**20:.1f} MiB, over the {limit_mib:g} MiB limit")
    return manifest


def verify(out: Path, limit_mib: float = LIMIT_MIB) -> str:
    """The bundle in `out` is what the lent machine can install (the wheels bundle.json lists, whole, none the image
    holds, under the limit; pip's offline dry run takes them): a one-line summary, or BundleError."""
    if not (out / "bundle.json").is_file() or not (out / "install.sh").is_file():
        raise BundleError(f"{out} has no bundle.json or install.sh: build it with make gpu-bundle")
    manifest = json.loads((out / "bundle.json").read_text())
    wheels = {w.name: w.stat().st_size for w in out.glob("*.whl")}
    if wheels != manifest["wheels"]:
        raise BundleError(f"{out}: its wheels differ from bundle.json's list (rebuild it)")
    image = image_packages()
    for name in wheels:
        if canonical(name.split("-")[0]) in image:
            raise BundleError(f"{name} is a package the image holds: the carried copy would shadow the image's")
        with zipfile.ZipFile(out / name) as z:
            record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
            for row in csv.reader(io.StringIO(z.read(record).decode())):
                if row and row[1] and record_hash(z.read(row[0])) != row[1]:
                    raise BundleError(f"{name}: {row[0]} does not match its RECORD")
    if not any(name.startswith("ray-") for name in wheels):
        raise BundleError(f"{out} holds no ray wheel")
    total = sum(wheels.values()) + (out / "install.sh").stat().st_size
    if total > limit_mib * 2**20:
        raise BundleError(f"the bundle in {out} is {total / 2**20:.1f} MiB, over the {limit_mib:g} MiB limit")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-index",
                               "--no-deps", "--target", tmp, *pip_target_flags(manifest["python_version"]),
                               *map(str, sorted(out.glob("*.whl")))], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip would not install {out}'s wheels for cp{manifest['python_version']}: "
                          f"{last_error(proc.stderr)}")
    return (f"{out}: {len(wheels)} wheels, {total / 2**20:.1f} MiB, whole and installable offline for "
            f"cp{manifest['python_version'].replace('.', '')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_bundle.sh", description=__doc__.split("\n")[0])
    p.add_argument("--python-version", default="3.12", help="the target python, X.Y (default 3.12: the image's)")
    p.add_argument("--output", default=str(ROOT / "gpu-bundle"), help="the bundle folder (default gpu-bundle/)")
    p.add_argument("--verify", metavar="DIR", default=None, help="check a built bundle instead of building one")
    args = p.parse_args(argv)
    try:
        if args.verify:
            print(verify(Path(args.verify)))
            return 0
        m = build(args.python_version, Path(args.output))
    except BundleError as e:
        print(f"error: bench/gpu_bundle.sh: {e}", file=sys.stderr)
        return 2
    for s in m["slimmed"]:
        print(f"{s['wheel']}: {s['bytes_before'] / 2**20:.1f} -> {s['bytes_after'] / 2**20:.1f} MiB "
              f"({s['removed_files']} files under {', '.join(s['removed_prefixes'])} removed)")
    print(f"bundle for cp{args.python_version.replace('.', '')}: {len(m['wheels'])} wheels "
          f"({', '.join(sorted(m['wheels']))}), {m['total_bytes'] / 2**20:.1f} MiB in {args.output}; "
          f"install: . {args.output}/install.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
