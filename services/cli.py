"""The `skiff` command: `serve` runs a whole local stack; `gateway`, `scheduler` and `worker`
run one service each (that is how the containers run them); `auth-callout` admits pods to NATS
by their service-account tokens."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from argparse import Namespace
    from types import FrameType

    from services.launcher import StackConfig
    from shared.cli_args import ConfigParser


# The gateway's and the workers' settings that `skiff serve` takes; the stack sets the others
# that tie the processes together, and the rest keep their defaults (or SKIFF_* variables).
SERVE_GATEWAY_FIELDS = ("host", "port", "api_key", "api_keys_file", "served_model_name")
SERVE_RUNNER_FIELDS = (
    "kv_cache_gib",
    "cpu_weights",
    "kv_offloading_size",
    "kv_offloading_disk_size",
    "kv_offloading_disk_path",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
)
SERVE_SCHEDULER_SERVICE_FIELDS = ("lora_modules", "lora_root")


def build_serve_parser() -> ConfigParser:
    from services.gateway.config import GatewayConfig
    from services.launcher import StackConfig
    from services.scheduler.config import SchedulerServiceConfig
    from services.worker.config import SIM_DEVICE, RunnerConfig, SimConfig
    from shared.cli_args import ConfigParser
    from shared.config import SchedulerConfig

    p = ConfigParser(prog="skiff serve", description="Run the whole stack locally.")
    p.add_argument(
        "--model", default=p.env("model"), help="HF-format model directory (default: embedded)"
    )
    p.add_argument(
        "--worker-device",
        default=p.env("worker_device", RunnerConfig.device),
        help=f"device of every worker; {SIM_DEVICE}: simulated workers, all in one process",
    )
    p.add_config(StackConfig, build=False)
    p.add_config(GatewayConfig, only=SERVE_GATEWAY_FIELDS, build=False)
    p.add_config(RunnerConfig, only=SERVE_RUNNER_FIELDS, build=False)
    p.add_config(SchedulerServiceConfig, only=SERVE_SCHEDULER_SERVICE_FIELDS, build=False)
    p.add_config(SchedulerConfig)
    p.add_config(SimConfig)
    return p


def stack_config(
    parser: ConfigParser,
    args: Namespace,
    configs: dict[type, Any],
    model_dir: str,
    log_dir: str | None = None,
) -> StackConfig:
    """The stack that `skiff serve`'s parsed flags describe, serving `model_dir`: the model
    is named as --served-model-name says, else as --model, else as the embedded model."""
    from services.gateway.config import GatewayConfig
    from services.launcher import StackConfig
    from services.scheduler.config import SchedulerServiceConfig
    from services.worker.config import RunnerConfig, SimConfig
    from shared.config import SchedulerConfig
    from shared.default_model import DEFAULT_MODEL_NAME

    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else args.model)
    return parser.config(
        StackConfig,
        args,
        gateway=parser.config(GatewayConfig, args, served_model_name=name),
        runner=parser.config(RunnerConfig, args, model_dir=model_dir, device=args.worker_device),
        scheduler_service=parser.config(SchedulerServiceConfig, args),
        scheduler=configs[SchedulerConfig],
        sim=configs[SimConfig],
        log_dir=log_dir,
    )


def serve(argv: list[str]) -> int:
    from services.launcher import Stack, StartupError
    from shared.default_model import cache_root

    parser = build_serve_parser()
    args, configs = parser.parse_configs(argv)
    model = args.model
    if model is None:
        from services.worker.gguf_convert import ensure_default_model
        from shared.default_model import default_model_dir, is_prepared

        if not is_prepared(default_model_dir()):
            print("skiff: preparing the embedded default model (first run only)", flush=True)
        model = str(ensure_default_model())
    log_dir = str(cache_root() / "logs")
    config = stack_config(parser, args, configs, model, log_dir)
    name = config.served_model_name
    stack = Stack(config, supervise=True)
    # The first SIGINT or SIGTERM stops the stack (later ones are ignored, so that nothing
    # cuts the drain short): while starting it interrupts the start, afterwards the loop
    # below sees it. Explicit handlers: a shell may start us with SIGINT ignored.
    state = {"starting": True, "stop": False}

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        if state["stop"]:
            return
        state["stop"] = True
        if state["starting"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"skiff: service logs go to {log_dir}", flush=True)
    try:
        stack.start(progress=lambda msg: print(f"skiff: {msg}", flush=True))
        state["starting"] = False
    except (StartupError, FileNotFoundError) as exc:
        print(f"skiff: failed to start: {exc}", file=sys.stderr)
        _print_log_tails(log_dir)
        return 1
    except KeyboardInterrupt:
        stack.stop()  # a no-op unless the signal came just after the start
        return 130
    print(
        f"\nskiff is serving {name} at {stack.url}/v1\n"
        f"try:\n  curl {stack.url}/v1/completions -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{name}", "prompt": "Hello, my name is", '
        f'"max_tokens": 16}}\'\n\nA process that exits is restarted; Ctrl-C stops everything.',
        flush=True,
    )
    while not state["stop"]:
        time.sleep(0.2)
    print("skiff: stopping: the gateway finishes its streams, then the rest stops", flush=True)
    stack.stop()
    print("skiff: stopped", flush=True)
    return 0


def _print_log_tails(log_dir: str, lines: int = 15) -> None:
    for log in sorted(Path(log_dir).glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log} (last {len(tail)} lines)", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("serve", "gateway", "scheduler", "worker", "auth-callout", "hash-key")
    if not argv or argv[0] not in commands:
        print(
            f"usage: skiff {{{','.join(commands)}}} [options]  (skiff COMMAND --help)",
            file=sys.stderr,
        )
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    if command == "serve":
        sys.exit(serve(rest))
    if command == "hash-key":
        from services.gateway.key_file import hash_key_main

        sys.exit(hash_key_main(rest))
    if command == "gateway":
        from services.gateway.main import main as run
    elif command == "scheduler":
        from services.scheduler.main import main as run
    elif command == "auth-callout":
        from services.auth_callout.main import main as run
    else:
        from services.worker.main import main as run
    run(rest)


if __name__ == "__main__":
    main()
