"""Put Debian's `prometheus` and `promtool` next to this interpreter (.venv/bin) for the
observability tests.

The binaries come from the distribution's own package, without root: `apt-get download
prometheus` fetches the .deb through the system's apt sources and `dpkg-deb -x` unpacks it into
a temporary folder, from which the two binaries are copied (after an `apt-get update` where
the machine has no package lists yet). A `prometheus` already on PATH (the
package installed) is used as it is. Idempotent: binaries already in place are kept.

    python tests/observability/install_prometheus.py [--dest DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BINARIES = ("prometheus", "promtool")


def install(dest: Path) -> None:
    if all((dest / b).is_file() for b in BINARIES):
        print(f"prometheus and promtool already in {dest}")
        return
    if all(shutil.which(b) for b in BINARIES):
        print("prometheus and promtool are on PATH (the Debian package)")
        return
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise SystemExit(
            "no apt-get/dpkg-deb: install Prometheus (prometheus and promtool on PATH) yourself"
        )
    with tempfile.TemporaryDirectory() as tmp:
        download = ["apt-get", "download", "prometheus"]
        if subprocess.run(download, cwd=tmp).returncode != 0:
            # a fresh machine has no package lists yet (needs root, as CI has)
            subprocess.run(["apt-get", "update", "-q"], check=True)
            subprocess.run(download, cwd=tmp, check=True)
        (deb,) = Path(tmp).glob("prometheus_*.deb")
        root = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        for name in BINARIES:
            partial = dest / f"{name}.partial"
            shutil.copyfile(root / "usr" / "bin" / name, partial)
            partial.chmod(0o755)
            partial.replace(dest / name)
        print(f"prometheus and promtool from {deb.name} installed in {dest}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(sys.executable).parent)
    install(parser.parse_args().dest)


if __name__ == "__main__":
    main()
