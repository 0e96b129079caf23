"""A real Kubernetes v1.20 cluster on this machine, for the cluster tests: etcd, kube-apiserver
(RBAC, service-account tokens, admission), kube-controller-manager and kube-scheduler, and one
node "localhost": the kubelet on containerd + runc with the CNI bridge, kube-proxy (iptables) and
a cluster DNS. Every process is started here and stopped by PID; pods live in network
namespaces on the bridge `BRIDGE`, so nothing leaves the machine. Needs root.

    python -m tests.cluster.localkube.cluster up|down   # by hand; the tests use LocalCluster
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import yaml
from kubernetes import client, config

from tests.cluster.kube import wait_until
from tests.cluster.localkube.pki import Pki, make_pki

ROOT = Path(__file__).resolve().parents[3]
BUILD = Path(__file__).with_name("build.sh")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "skiff" / "k8s"
BIN = CACHE / "v1.20.2" / "bin"
STATE = Path("/var/tmp/skiff-localkube")  # fixed: a later run cleans up after a killed one
CONTAINERD_ROOT = CACHE / "containerd"  # kept between runs: imported images stay

BRIDGE = "skiffbr0"
POD_CIDR = "10.244.0.0/24"
HOST_IP = "10.244.0.1"  # the node's address on the bridge: API server and DNS for the pods
SERVICE_CIDR = "10.96.0.0/16"
API_PORT = 6443
ETCD_PORTS = (23790, 23800)
NODE = "localhost"
# only pods that tolerate it land on the node (the tests' values do): nothing unplanned runs
NODE_TAINT = "skiff.test/local-node=true:NoSchedule"
PAUSE_IMAGE = "registry.k8s.io/pause:3.6"


def build_binaries() -> Path:
    """The v1.20.2 binaries, built from Debian's source on first use (minutes) and cached."""
    subprocess.run(["bash", str(BUILD), str(BIN)], check=True)
    return BIN


class LocalCluster:
    def __init__(self, state: Path = STATE, bin_dir: Path = BIN) -> None:
        self.state, self.bin = state, bin_dir
        self.pids = state / "pids"
        self.logs = state / "logs"
        self.pki = Pki(state / "pki")
        self.socket = state / "containerd" / "containerd.sock"

    @property
    def server(self) -> str:
        return f"https://{HOST_IP}:{API_PORT}"

    @property
    def kubeconfig(self) -> Path:
        return self.pki.kubeconfig("admin")

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self, images: Sequence[Path] = ()) -> None:
        """The control plane, then the node with `images` (OCI archives) imported before
        anything can be scheduled there."""
        self.stop()
        for sub in ("etcd", "kubelet", "logs", "cni", "pki"):
            subprocess.run(["rm", "-rf", str(self.state / sub)], check=True)
        self.logs.mkdir(parents=True)
        _network_up()
        make_pki(self.pki.dir, self.server, [HOST_IP, "127.0.0.1", "10.96.0.1"])
        self._control_plane()
        self._containerd(images)
        self._node()

    def stop(self) -> None:
        """Every process this cluster started (also those of an earlier, killed run), its
        containers, mounts, network namespaces, iptables rules and bridge."""
        started = self._read_pids()
        for name, pid in reversed(started):
            if name == "containerd":
                self._remove_containers()
            _terminate(pid)
        _kill_shims(self.socket)
        self.pids.unlink(missing_ok=True)
        _unmount_under(self.state)
        _unmount_under(CONTAINERD_ROOT)
        if (self.bin / "kube-proxy").exists() and started:
            subprocess.run(
                [str(self.bin / "kube-proxy"), "--cleanup"], capture_output=True, check=False
            )
        _flush_kube_chains()
        _network_down()

    # ---- processes -----------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        with self.pids.open("a") as f:
            f.write(f"{name} {proc.pid}\n")

    def _read_pids(self) -> list[tuple[str, int]]:
        if not self.pids.exists():
            return []
        rows = [line.split() for line in self.pids.read_text().splitlines() if line.strip()]
        return [(name, int(pid)) for name, pid in rows]

    def _control_plane(self) -> None:
        p, etcd_client, etcd_peer = self.pki, *ETCD_PORTS
        self._spawn("etcd", [
            "etcd", "--name", "local", "--data-dir", str(self.state / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"local=http://127.0.0.1:{etcd_peer}",
            "--listen-metrics-urls", "", "--quota-backend-bytes", str(2 << 30),
        ])  # fmt: skip
        self._spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_client}",
            f"--bind-address={HOST_IP}", f"--advertise-address={HOST_IP}",
            f"--secure-port={API_PORT}", "--insecure-port=0",
            f"--tls-cert-file={p.cert('apiserver')}",
            f"--tls-private-key-file={p.key('apiserver')}",
            f"--client-ca-file={p.ca}",
            f"--kubelet-client-certificate={p.cert('apiserver-kubelet-client')}",
            f"--kubelet-client-key={p.key('apiserver-kubelet-client')}",
            f"--kubelet-certificate-authority={p.ca}",
            "--kubelet-preferred-address-types=Hostname,InternalIP",
            f"--service-account-key-file={p.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={p.dir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction", "--profiling=false", "--v=1",
        ])  # fmt: skip
        self._wait("the API server ready", self._api_ready, 90)
        common = ["--bind-address=127.0.0.1", "--port=0", "--leader-elect=false", "--v=1"]
        cm = p.kubeconfig("controller-manager")
        self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={cm}",
            f"--authentication-kubeconfig={cm}", f"--authorization-kubeconfig={cm}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={p.dir / 'sa.key'}", f"--root-ca-file={p.ca}",
            f"--cluster-signing-cert-file={p.ca}", f"--cluster-signing-key-file={p.dir / 'ca.key'}",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-route,-service",
            "--node-monitor-grace-period=20s", "--pod-eviction-timeout=30s", *common,
        ])  # fmt: skip
        sched = p.kubeconfig("scheduler")
        self._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), f"--kubeconfig={sched}",
            f"--authentication-kubeconfig={sched}", f"--authorization-kubeconfig={sched}",
            *common,
        ])  # fmt: skip

    def _containerd(self, images: Sequence[Path]) -> None:
        config = subprocess.run(
            ["containerd", "config", "default"], capture_output=True, text=True, check=True
        ).stdout
        (self.state / "containerd").mkdir(parents=True, exist_ok=True)
        (self.state / "cni").mkdir(parents=True, exist_ok=True)
        replace = {
            'root = "/var/lib/containerd"': f'root = "{CONTAINERD_ROOT}"',
            'state = "/run/containerd"': f'state = "{self.state / "containerd" / "state"}"',
            'address = "/run/containerd/containerd.sock"': f'address = "{self.socket}"',
            'bin_dir = "/opt/cni/bin"': 'bin_dir = "/usr/lib/cni"',
            'conf_dir = "/etc/cni/net.d"': f'conf_dir = "{self.state / "cni"}"',
            # this VM lacks CAP_SYS_RESOURCE: runc cannot lower a container's oom_score_adj
            "restrict_oom_score_adj = false": "restrict_oom_score_adj = true",
        }
        for old, new in replace.items():
            assert old in config, f"containerd's default config has no {old!r}"
            config = config.replace(old, new)
        config = _set_sandbox_image(config, PAUSE_IMAGE)
        (self.state / "containerd" / "config.toml").write_text(config)
        (self.state / "cni" / "10-bridge.conflist").write_text(json.dumps(_cni_config()))
        self._spawn(
            "containerd", ["containerd", "--config", str(self.state / "containerd" / "config.toml")]
        )
        self._wait("containerd", lambda: self._ctr_ok("version"), 30)
        for archive in images:
            subprocess.run(
                [*self._ctr(), "-n", "k8s.io", "images", "import", "--no-unpack", str(archive)],
                check=True,
                capture_output=True,
            )

    def _node(self) -> None:
        p = self.pki
        kubelet_dir = self.state / "kubelet"
        kubelet_dir.mkdir(parents=True, exist_ok=True)
        (kubelet_dir / "config.yaml").write_text(yaml.safe_dump(_kubelet_config(p)))
        self._spawn("kubelet", [
            str(self.bin / "kubelet"), f"--config={kubelet_dir / 'config.yaml'}",
            f"--kubeconfig={p.kubeconfig('kubelet')}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{self.socket}",
            f"--register-with-taints={NODE_TAINT}", f"--hostname-override={NODE}",
            f"--root-dir={kubelet_dir / 'root'}", "--v=1",
        ])  # fmt: skip
        self._spawn("kube-proxy", [
            str(self.bin / "kube-proxy"), f"--kubeconfig={p.kubeconfig('kube-proxy')}",
            "--proxy-mode=iptables", f"--cluster-cidr={POD_CIDR}", "--masquerade-all",
            f"--hostname-override={NODE}", "--conntrack-max-per-core=0", "--oom-score-adj=0",
            "--metrics-bind-address=127.0.0.1:10249", "--healthz-bind-address=127.0.0.1:10256",
        ])  # fmt: skip
        self._spawn("cluster-dns", [
            sys.executable, "-m", "tests.cluster.localkube.dns",
            "--kubeconfig", str(self.kubeconfig), "--listen", HOST_IP,
        ])  # fmt: skip
        self._wait(f"node {NODE} Ready", self._node_ready, 120)
        self._wait("the default service account", self._default_account, 60)

    # ---- tools ---------------------------------------------------------------------------

    def api(self) -> client.ApiClient:
        """A client of the API server as the cluster's admin."""
        return config.new_client_from_config(str(self.kubeconfig))

    def _api_ready(self) -> bool:
        p = self.pki
        with contextlib.suppress(httpx.HTTPError):
            cert = (str(p.cert("admin")), str(p.key("admin")))
            ctx = ssl.create_default_context(cafile=str(p.ca))
            ctx.load_cert_chain(*cert)
            return httpx.get(f"{self.server}/readyz", verify=ctx, timeout=2).status_code == 200
        return False

    def _node_ready(self) -> bool:
        with contextlib.suppress(client.ApiException):
            node = client.CoreV1Api(self.api()).read_node(NODE)
            return any(
                c.type == "Ready" and c.status == "True" for c in node.status.conditions or []
            )
        return False

    def _default_account(self) -> bool:
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(self.api()).read_namespaced_service_account("default", "default")
            return True
        return False

    def _ctr(self) -> list[str]:
        return ["ctr", "--address", str(self.socket)]

    def _ctr_ok(self, *args: str) -> bool:
        return (
            subprocess.run([*self._ctr(), *args], capture_output=True, check=False).returncode == 0
        )

    def _remove_containers(self) -> None:
        """Kill and remove every container: their shims would outlive containerd."""
        if not self.socket.exists():
            return
        listed = subprocess.run(
            [*self._ctr(), "-n", "k8s.io", "containers", "ls", "-q"],
            capture_output=True,
            text=True,
            check=False,
        )
        for container in listed.stdout.split():
            for cmd in (
                ["tasks", "kill", "-s", "KILL", container],
                ["tasks", "rm", "-f", container],
            ):
                subprocess.run(
                    [*self._ctr(), "-n", "k8s.io", *cmd], capture_output=True, check=False
                )
            subprocess.run(
                [*self._ctr(), "-n", "k8s.io", "containers", "rm", container],
                capture_output=True,
                check=False,
            )

    def _wait(self, what: str, ready: Callable[[], bool], timeout_s: float) -> None:
        wait_until(f"{what} (logs in {self.logs})", ready, timeout_s, every_s=0.5)


def _set_sandbox_image(config: str, image: str) -> str:
    lines = config.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("sandbox_image ="):
            lines[i] = line.split("sandbox_image")[0] + f'sandbox_image = "{image}"'
    return "\n".join(lines) + "\n"


def _cni_config() -> dict[str, object]:
    return {
        "cniVersion": "0.4.0",
        "name": "skiff-localkube",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": HOST_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def _kubelet_config(p: Pki) -> dict[str, object]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(p.cert("kubelet-serving")),
        "tlsPrivateKeyFile": str(p.key("kubelet-serving")),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(p.ca)},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "clusterDomain": "cluster.local",
        "clusterDNS": [HOST_IP],
        "resolvConf": "",  # pods search only the cluster's domains: no name leaves the machine
        "failSwapOn": False,
        "makeIPTablesUtilChains": False,
        "evictionHard": {
            "memory.available": "200Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "serializeImagePulls": False,
        "maxPods": 40,
    }


# ---- host network and leftovers ------------------------------------------------------------


def _network_up() -> None:
    _ip("link", "add", BRIDGE, "type", "bridge", check=False)
    _ip("addr", "replace", f"{HOST_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")


def _network_down() -> None:
    for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split(
        "\n"
    ):
        name = ns.split(" ")[0]
        if name.startswith("cni-"):
            _ip("netns", "delete", name, check=False)
    _ip("link", "delete", BRIDGE, check=False)
    subprocess.run(["rm", "-rf", "/var/lib/cni/networks/skiff-localkube"], check=False)
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        for top in ("kubepods", "k8s.io"):
            tree = hierarchy / top
            if tree.is_dir():
                subprocess.run(
                    ["find", str(tree), "-depth", "-type", "d", "-exec", "rmdir", "{}", ";"],
                    capture_output=True,
                    check=False,
                )


def _flush_kube_chains() -> None:
    """The KUBE-* iptables chains the kubelet and kube-proxy leave behind."""
    for table in ("nat", "filter", "mangle"):
        rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True)
        chains = [
            line.split()[1] for line in rules.stdout.splitlines() if line.startswith("-N KUBE-")
        ]
        for flag in ("-F", "-X"):
            for chain in chains:
                subprocess.run(["iptables", "-t", table, flag, chain], capture_output=True)


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], capture_output=True, check=check)


def _terminate(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group of `pid`, SIGKILL after `grace_s`. A process this one started
    is reaped as it exits: until then it is a zombie, still in its group, and the group would
    seem alive for the whole grace (10 s for each of the cluster's processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):  # not this process's child
            os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill_shims(socket: Path) -> None:
    """containerd's runc shims of this cluster (they run in sessions of their own)."""
    found = subprocess.run(
        ["pgrep", "-f", f"containerd-shim.*{socket}"], capture_output=True, text=True
    )
    for pid in found.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _unmount_under(path: Path) -> None:
    mounts = subprocess.run(
        ["findmnt", "-rn", "-o", "TARGET"], capture_output=True, text=True, check=False
    ).stdout.split()
    for target in sorted((m for m in mounts if m.startswith(str(path))), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


@contextlib.contextmanager
def running(images: Sequence[Path] = ()) -> Iterator[LocalCluster]:
    cluster = LocalCluster(bin_dir=build_binaries())
    try:
        cluster.start(images)
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else "up"
    cluster = LocalCluster(bin_dir=build_binaries())
    if cmd == "up":
        cluster.start([Path(a) for a in sys.argv[2:]])
        print(f"export KUBECONFIG={cluster.kubeconfig}")
    else:
        cluster.stop()
