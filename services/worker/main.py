"""`skiff worker`: load a model on one device and serve plans (flags and SKIFF_* variables
from its configs)."""

from __future__ import annotations

import asyncio
import dataclasses

from services.worker.model_runner import RunnerConfig, build_runner
from services.worker.service import WorkerService
from shared.cli_args import ConfigParser, setup_logging, wait_for_signal
from shared.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    WorkerServiceConfig,
)


def build_parser() -> ConfigParser:
    p = ConfigParser(prog="skiff worker", description=__doc__)
    p.add_config(WorkerServiceConfig)
    p.add_argument(
        "--model",
        default=p.env("model"),
        help="HF-format model directory (default: the embedded SmolLM2)",
    )
    p.add_argument("--device", default=p.env("device", "cpu"))
    p.add_argument("--dtype", default=p.env("dtype", "float32"))
    p.add_argument("--kv-cache-gib", type=float, default=p.env("kv_cache_gib", 1.0, float))
    p.add_argument("--block-size", type=int, default=p.env("block_size", DEFAULT_BLOCK_SIZE, int))
    p.add_argument(
        "--max-num-seqs", type=int, default=p.env("max_num_seqs", DEFAULT_MAX_NUM_SEQS, int)
    )
    p.add_argument(
        "--max-model-len", type=int, default=p.env("max_model_len", DEFAULT_MAX_MODEL_LEN, int)
    )
    return p


async def serve(argv: list[str] | None = None) -> None:
    args, configs = build_parser().parse_configs(argv)
    config: WorkerServiceConfig = configs[WorkerServiceConfig]
    setup_logging(config.log_level, "worker")
    model = args.model
    if model is None:
        from services.worker.gguf_convert import ensure_default_model

        model = str(ensure_default_model())
    runner = build_runner(
        RunnerConfig(
            model_dir=model,
            kv_cache_gib=args.kv_cache_gib,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            device=args.device,
            dtype=args.dtype,
        )
    )
    from shared.default_model import DEFAULT_MODEL_NAME

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
