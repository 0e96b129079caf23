"""`skiff worker`: load a model on one device and serve plans."""

from __future__ import annotations

import argparse
import asyncio

from services.worker.model_runner import build_runner
from services.worker.service import WorkerService
from shared.cli_args import add_common, env_default, setup_logging, wait_for_signal
from shared.config import WorkerServiceConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="skiff worker", description=__doc__)
    add_common(p)
    p.add_argument(
        "--model",
        default=env_default("model", None),
        help="HF-format model directory (default: the embedded SmolLM2)",
    )
    p.add_argument("--served-model-name", default=env_default("served_model_name", ""))
    p.add_argument("--worker-id", default=env_default("worker_id", "worker-0"))
    p.add_argument("--device", default=env_default("device", "cpu"))
    p.add_argument("--dtype", default=env_default("dtype", "float32"))
    p.add_argument("--kv-cache-gib", type=float, default=env_default("kv_cache_gib", 1.0, float))
    p.add_argument("--block-size", type=int, default=env_default("block_size", 16, int))
    p.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", 256, int))
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len", 8192, int))
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    model = args.model
    if model is None:
        from services.worker.gguf_convert import ensure_default_model

        model = str(ensure_default_model())
    runner = build_runner(
        model,
        kv_cache_gib=args.kv_cache_gib,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
    )
    from shared.default_model import DEFAULT_MODEL_NAME

    name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else model)
    service = WorkerService(
        WorkerServiceConfig(
            nats_url=args.nats_url,
            subject_prefix=args.subject_prefix,
            worker_id=args.worker_id,
            model_name=name,
        ),
        runner,
    )
    await service.start()
    await wait_for_signal()
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, "worker")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
