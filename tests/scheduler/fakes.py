"""Stand-ins for what the scheduler's parts meet on NATS: worker hellos and a publisher."""

from __future__ import annotations

import msgspec

from shared.protocol import WorkerHello, encode


def make_hello(
    worker_id: str = "w0",
    *,
    instance_id: str = "i0",
    block_size: int = 16,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    max_num_seqs: int = 256,
    vocab_size: int = 1000,
) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        instance_id=instance_id,
        model="m",
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        device="cpu",
        vocab_size=vocab_size,
        eos_token_ids=[2],
    )


class FakePublisher:
    """Records what would go onto NATS, as (subject, message)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, msgspec.Struct]] = []

    async def __call__(self, subject: str, msg: msgspec.Struct) -> int:
        self.sent.append((subject, msg))
        return len(encode(msg))
