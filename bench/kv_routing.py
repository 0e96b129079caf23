"""Prefix-aware shard routing, simulated: the prefix-cache hit rate of multi-turn chats routed
over scheduler shards by prefix, by load, and held by one shard as large as all of them.

    python -m bench.kv_routing [--conversations 48] [--turns 6] [--shards 4]
                               [--blocks-per-shard 512] [--concurrency 8] [--heartbeat-every 8]

No NATS and no model: each shard is one worker's `KVCacheManager` with a fixed number of
blocks. The workload: conversations that share a system prompt (every shard soon holds it,
so a first-block match tells the shards apart no better than load) start at random times;
each turn resends the conversation's history with a new user message, and its answer joins
the history (random token ids). A turn takes the blocks of its prompt when it arrives (the
prefix-cache lookup counts its hits and queries, as the scheduler's do) and of its answer
when it finishes, then frees them, to stay cached until evicted (LRU); `--concurrency` turns
run at once, and a conversation's next turn waits for its previous answer.

Routings, on the same turns: (a) prefix: the gateway's `Shards.route` over heartbeats that
carry each shard's prefix summary, built by the scheduler's own `summarize` every
`--heartbeat-every` requests (the heartbeat period); (b) load: the same `Shards` routing by
load only; (c) one giant shard with every shard's blocks. Prints the token hit rates and the
ratio of prefix routing to the giant shard.
"""

from __future__ import annotations

import argparse
import collections
import random
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.shards import Shards
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.prefix_summaries import summarize
from services.scheduler.request import Request
from shared.prefix_summary import DEFAULT_MAX_BYTES
from shared.sampling_params import SamplingParams
from shared.wire import SchedulerHeartbeat

VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: its prompt (the history and a new user message) and the
    answer it gets."""

    conversation: int
    prompt: list[int]
    answer: list[int]


@dataclass(frozen=True)
class Workload:
    num_conversations: int = 48
    num_turns: int = 6
    system_tokens: int = 320
    user_tokens: tuple[int, int] = (40, 160)  # uniform range of a user message's length
    answer_tokens: tuple[int, int] = (100, 220)
    mean_gap: float = 0.3  # between a conversation's turns; starts spread over one time unit
    seed: int = 0

    def turns(self) -> list[Turn]:
        """Every turn, in arrival order (conversations interleaved)."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

        system = tokens(self.system_tokens)
        arrivals: list[tuple[float, int]] = []
        for conversation in range(self.num_conversations):
            t = rng.random()
            for _ in range(self.num_turns):
                arrivals.append((t, conversation))
                t += rng.uniform(0.5, 1.5) * self.mean_gap
        histories = {c: list(system) for c in range(self.num_conversations)}
        turns = []
        for _, conversation in sorted(arrivals):
            prompt = histories[conversation] + tokens(rng.randint(*self.user_tokens))
            answer = tokens(rng.randint(*self.answer_tokens))
            histories[conversation] = prompt + answer
            turns.append(Turn(conversation, prompt, answer))
        return turns


class SimShard:
    """One shard: a worker's KV blocks and the turns running on it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size)
        self.running: dict[str, Request] = {}

    def admit(self, request: Request) -> bool:
        """Look its prompt up in the prefix cache and take blocks for the rest."""
        computed, num_computed = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - num_computed
        if self.kv.allocate_slots(request, num_new, computed) is None:
            return False
        self.kv.record_lookup(request.num_tokens, num_computed)  # as the scheduler counts
        request.num_computed_tokens = request.num_tokens
        self.running[request.req_id] = request
        return True

    def finish(self, request: Request, answer: list[int]) -> None:
        """Decode its answer into blocks (cached once full), then free them all."""
        del self.running[request.req_id]
        for token_id in answer:
            request.append_output_token(token_id)
        if self.kv.allocate_slots(request, len(answer)) is not None:
            request.num_computed_tokens = request.num_tokens
        self.kv.forget(request)


Router = Callable[[list[int]], int]  # the shard a prompt goes to


class GatewayRouter:
    """The gateway's `Shards` routing, fed heartbeats built as the scheduler builds them."""

    def __init__(self, num_shards: int, routing: str, max_imbalance: float, max_bytes: int) -> None:
        self.shards = Shards("sim", num_shards, float("inf"), routing, max_imbalance)
        self.max_bytes = max_bytes

    def heartbeat(self, shards: list[SimShard]) -> None:
        for index, shard in enumerate(shards):
            block_size, summary = summarize([shard.kv], self.max_bytes)
            beat = SchedulerHeartbeat(
                epoch="sim",
                num_ready_workers=1,
                num_running=len(shard.running),
                block_size=block_size,
                prefix_summary=summary,
            )
            self.shards.heartbeat(index, beat)

    def __call__(self, token_ids: list[int]) -> int:
        route = self.shards.route(token_ids=token_ids)
        assert route is not None, "every simulated shard is available"
        self.shards.count(route)
        self.shards[route.shard].submitted += 1  # as the gateway counts its submits
        return route.shard


def simulate(
    turns: list[Turn],
    shards: list[SimShard],
    route: Router,
    heartbeat: Callable[[list[SimShard]], None],
    concurrency: int,
    heartbeat_every: int,
) -> float:
    """Run the turns in order over `shards`; the prefix-cache hit rate in tokens."""
    running: collections.OrderedDict[int, tuple[SimShard, Request, list[int]]] = (
        collections.OrderedDict()
    )  # by conversation, oldest first

    def finish_oldest(on: SimShard | None = None) -> bool:
        for conversation, (shard, request, answer) in running.items():
            if on is None or shard is on:
                del running[conversation]
                shard.finish(request, answer)
                return True
        return False

    for index, turn in enumerate(turns):
        if turn.conversation in running:  # its previous answer first, and all older ones
            while turn.conversation in running:
                finish_oldest()
        while len(running) >= concurrency:
            finish_oldest()
        if index % heartbeat_every == 0:
            heartbeat(shards)
        shard = shards[route(turn.prompt)]
        request = Request(f"t{index}", turn.prompt, SamplingParams())
        while not shard.admit(request):
            if not finish_oldest(on=shard):
                raise RuntimeError("a shard has fewer blocks than one request needs")
        running[turn.conversation] = (shard, request, turn.answer)
    while finish_oldest():
        pass
    hits = sum(s.kv.prefix_hits for s in shards)
    queries = sum(s.kv.prefix_queries for s in shards)
    return hits / queries if queries else 0.0


@dataclass(frozen=True)
class Result:
    prefix: float
    load: float
    giant: float
    routed: dict[str, int]  # prefix routing's requests by reason

    def lines(self) -> list[str]:
        reasons = ", ".join(f"{n} by {reason}" for reason, n in sorted(self.routed.items()))
        return [
            f"prefix routing: {reasons}",
            f"prefix hit rate: prefix routing {self.prefix:.3f}, load routing {self.load:.3f}, "
            f"one giant shard {self.giant:.3f}",
            f"prefix routing / giant shard: {self.prefix / self.giant if self.giant else 0.0:.2f}",
        ]


def run(
    workload: Workload,
    *,
    num_shards: int = 4,
    blocks_per_shard: int = 512,
    block_size: int = 16,
    concurrency: int = 8,
    heartbeat_every: int = 8,
    max_imbalance: float = 4.0,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Result:
    turns = workload.turns()

    def shards(n: int, num_blocks: int) -> list[SimShard]:
        return [SimShard(num_blocks, block_size) for _ in range(n)]

    rates: dict[str, float] = {}
    routed: collections.Counter[str] = collections.Counter()
    for routing in ("prefix", "load"):
        router = GatewayRouter(num_shards, routing, max_imbalance, max_bytes)
        sim = shards(num_shards, blocks_per_shard)
        rates[routing] = simulate(
            turns, sim, router, router.heartbeat, concurrency, heartbeat_every
        )
        if routing == "prefix":
            for shard in router.shards:
                routed.update(shard.routed)
    giant = simulate(
        turns,
        shards(1, num_shards * blocks_per_shard),
        lambda _: 0,
        lambda _: None,
        concurrency,
        heartbeat_every,
    )
    return Result(rates["prefix"], rates["load"], giant, dict(routed))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=Workload.num_conversations)
    p.add_argument("--turns", type=int, default=Workload.num_turns)
    p.add_argument("--system-tokens", type=int, default=Workload.system_tokens)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--blocks-per-shard", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="turns running at once")
    p.add_argument("--heartbeat-every", type=int, default=8, help="requests between heartbeats")
    p.add_argument("--max-imbalance", type=float, default=4.0)
    p.add_argument("--summary-max-bytes", type=int, default=DEFAULT_MAX_BYTES)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    workload = Workload(
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_tokens=args.system_tokens,
        seed=args.seed,
    )
    result = run(
        workload,
        num_shards=args.shards,
        blocks_per_shard=args.blocks_per_shard,
        block_size=args.block_size,
        concurrency=args.concurrency,
        heartbeat_every=args.heartbeat_every,
        max_imbalance=args.max_imbalance,
        max_bytes=args.summary_max_bytes,
    )
    for line in result.lines():
        print(line)


if __name__ == "__main__":
    main()
