"""The bundle for the lent GPU machine (`make gpu-bundle`): wheels of what the GPU check needs that the machine's
image lacks. The machine reaches no package registry and takes at most 64 MiB of working tree a call: the
requirements of `ray[train,tune,data]`, resolved for the target python, less what the image holds
(bench/gpu_image_packages.txt), as wheels, Ray's slimmed (`SLIM_PREFIXES`); `install.sh` installs them."""

from __future__ import annotations

import argparse
import csv
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
    return {canonical(w) for line in path.read_text().splitlines() if not line.startswith("#") for w in line.split()}


def image_versions(path: Path = IMAGE_PACKAGES) -> dict[str, str]:
    """The image's versions where they are known (the list's `# versions:` line): {name: version}."""
    lines = [line.split(":", 1)[1] for line in path.read_text().splitlines() if line.startswith("# versions:")]
    return dict(word.split("==", 1) for line in lines for word in line.split())


def pip(args: list[str], python_version: str, failed: str) -> None:
    """`pip ARGS` for the target python's wheels; BundleError(`failed`: pip's last error) if it fails."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--only-binary=:all:", "--python-version",
                           python_version, "--implementation", "cp", *[x for p in PLATFORMS for x in ("--platform", p)]],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise BundleError(f"{failed}: {lines[-1].strip() if lines else '(no message)'}")


def slim_wheel(path: Path, prefixes: tuple[str, ...]) -> dict:
    """Rewrite the wheel at `path` without its members under `prefixes`, RECORD rewritten to list exactly what is
    left: still a valid wheel of the same name."""
    with zipfile.ZipFile(path) as src:
        record = next((n for n in src.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1), None)
        if record is None:
            raise BundleError(f"{path.name}: not a wheel (no .dist-info/RECORD)")
        dropped = [n for n in src.namelist() if n.startswith(prefixes)]
        rows = csv.reader(io.StringIO(src.read(record).decode()))
        kept = [row for row in rows if row and not row[0].startswith(prefixes)]
        listed, tmp = {row[0] for row in kept}, path.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
            for info in src.infolist():
                if info.filename in dropped or info.filename == record:
                    continue
                if info.filename not in listed and not info.filename.endswith("/"):
                    raise BundleError(f"{path.name}: {info.filename} is not in its RECORD")
                dst.writestr(info, src.read(info.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows(kept)
            dst.writestr(record, text.getvalue())
    before = path.stat().st_size
    tmp.replace(path)
    return {"wheel": path.name, "removed_prefixes": list(prefixes), "removed_files": len(dropped),
            "bytes_before": before, "bytes_after": path.stat().st_size}


def build(python_version: str, out: Path, *, limit_mib: float = LIMIT_MIB) -> dict:
    """What pip would install for REQUIREMENTS on the target python (a dry run's report: metadata only), less the
    image's packages, downloaded as wheels; Ray's slimmed; install.sh and bundle.json beside them."""
    if not re.fullmatch(r"3\.\d+", python_version):
        raise BundleError(f"--python-version must look like 3.12, got {python_version!r}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    requirements, image = [r.format(ray=RAY_VERSION) for r in REQUIREMENTS], image_packages()
    with tempfile.TemporaryDirectory() as tmp:
        pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", f"{tmp}/report.json", "--target",
             f"{tmp}/target", *requirements], python_version,
            f"pip could not resolve {' '.join(requirements)} for cp{python_version}")
        resolved = [(i["metadata"]["name"], i["metadata"]["version"])
                    for i in json.loads(Path(tmp, "report.json").read_text())["install"]]
    carried = [(n, v) for n, v in resolved if canonical(n) not in image]
    pip(["download", "--quiet", "--no-deps", "-d", str(out), *[f"{n}=={v}" for n, v in carried]], python_version,
        "pip download failed")
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != len(carried):
        raise BundleError(f"expected {len(carried)} wheels in {out}, found {len(wheels)}")
    slimmed = [slim_wheel(w, SLIM_PREFIXES) for w in wheels if w.name.startswith("ray-")]
    (out / "install.sh").write_text(INSTALL_SH.format(name=out.name))
    sizes = {w.name: w.stat().st_size for w in wheels}
    manifest = {"python_version": python_version, "requirements": requirements,
                "image_packages": str(IMAGE_PACKAGES.relative_to(ROOT)),
                "from_image": sorted(f"{n}=={v}" for n, v in resolved if canonical(n) in image),
                "wheels": sizes, "slimmed": slimmed, "total_bytes": sum(sizes.values())
                + (out / "install.sh").stat().st_size}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if manifest["total_bytes"] > limit_mib * 2**20:
        raise BundleError(f"the bundle in {out} is {manifest['total_bytes'] / 2**20:.1f} MiB, over the {limit_mib:g} "
                          f"MiB limit")
    with tempfile.TemporaryDirectory() as tmp:  # what the lent machine's install line will do, offline
        pip(["install", "--dry-run", "--quiet", "--no-index", "--no-deps", "--target", tmp, *map(str, wheels)],
            python_version, f"pip would not install {out}'s wheels for cp{python_version}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_bundle.sh", description=__doc__)
    p.add_argument("--python-version", default="3.12", help="the target python, X.Y (default 3.12: the image's)")
    p.add_argument("--output", default=str(ROOT / "gpu-bundle"), help="the bundle folder (default gpu-bundle/)")
    args = p.parse_args(argv)
    try:
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
