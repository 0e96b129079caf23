"""`skiff worker`: load a model on one device and serve plans (flags and SKIFF_* variables
derived from its configs)."""

from __future__ import annotations

import asyncio
import dataclasses

from services.worker.config import RunnerConfig
from services.worker.service import WorkerService
from shared.cli_args import ConfigParser, config_from, setup_logging, wait_for_signal
from shared.config import WorkerServiceConfig
from shared.default_model import DEFAULT_MODEL_NAME


def build_parser() -> ConfigParser:
    p = ConfigParser(prog="skiff worker", description=__doc__)
    p.add_argument(
        "--model", default=p.env("model"), help="HF-format model directory (default: embedded)"
    )
    p.add_config(WorkerServiceConfig)
    p.add_config(RunnerConfig, build=False)
    return p


async def serve(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, configs = parser.parse_configs(argv)
    config: WorkerServiceConfig = configs[WorkerServiceConfig]
    setup_logging(config.log_level, "worker")
    from services.worker.model_runner import build_runner

    model = args.model
    if model is None:
        from services.worker.gguf_convert import ensure_default_model

        model = str(ensure_default_model())
    try:
        runner_config = config_from(RunnerConfig, args, model_dir=model)
    except ValueError as exc:
        parser.error(str(exc))
    runner = build_runner(runner_config)
    if not config.model_name:
        name = DEFAULT_MODEL_NAME if args.model is None else model
        config = dataclasses.replace(config, model_name=name)
    service = WorkerService(config, runner)
    await service.start()
    await wait_for_signal()
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(argv))


if __name__ == "__main__":
    main()
