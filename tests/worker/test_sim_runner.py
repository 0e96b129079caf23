"""The simulated runner: ModelRunner's bookkeeping on the persistent batch, deterministic tokens
and EOS, logprobs in the runner's shape, the modelled step time, and the worker service around
it (no torch anywhere)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from services.worker.config import RunnerConfig, SimConfig, WorkerServiceConfig
from services.worker.model_config import ModelConfig
from services.worker.service import WorkerService
from services.worker.sim_runner import (
    SIM_KV_CACHE_TOKENS,
    SimRunner,
    request_key,
    sample_tokens,
)
from shared import bus
from shared.sampling_params import SamplingParams
from shared.subjects import Subjects
from shared.wire import (
    BatchPlan,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    WorkerHello,
)

VOCAB, EOS = 50, (1, 3)
BS = 4  # block size


def write_model_config(path: Path, **overrides: object) -> Path:
    """A small Llama config.json in `path`: all a simulated worker reads of its model."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "eos_token_id": 1,
        "max_position_embeddings": 256,
        **overrides,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def model_dir(tmp_path):
    write_model_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return tmp_path


def runner(model_dir, eos_rate: float = 0.0, **config) -> SimRunner:
    config = {"block_size": BS, "max_num_seqs": 4, "num_blocks": 64, **config}
    return SimRunner(
        RunnerConfig(model_dir=str(model_dir), **config), SimConfig(sim_eos_rate=eos_rate)
    )


def new(req_id: str, prompt_len: int, blocks: list[int], **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling_params=SamplingParams(**params),
        block_ids=blocks,
        num_computed_tokens=0,
    )


def cached(req_id: str, computed: int, blocks=(), resumed=False) -> CachedRequestData:
    return CachedRequestData(
        req_id=req_id, new_block_ids=list(blocks), num_computed_tokens=computed, resumed=resumed
    )


def plan(step: int, sched: dict[str, int], **kw) -> BatchPlan:
    return BatchPlan(step_id=step, num_scheduled_tokens=sched, **kw)


def sampled(out: ModelRunnerOutput) -> dict[str, list[int]]:
    return dict(zip(out.req_ids, out.sampled_token_ids, strict=True))


def test_model_info_and_geometry(model_dir):
    r = runner(model_dir, num_blocks=None, max_model_len=4096)
    mc = r.model_config
    assert (mc.vocab_size, mc.eos_token_ids, mc.max_position_embeddings) == (VOCAB, EOS, 256)
    assert r.max_model_len == 256  # capped by the model's
    assert r.num_blocks == r.config.num_blocks == SIM_KV_CACHE_TOKENS // BS
    assert runner(model_dir, num_blocks=7).num_blocks == 7
    assert str(r.device) == "sim"


def test_chunked_prefill_decode_and_finish(model_dir):
    r = runner(model_dir)
    out = r.execute(plan(1, {"a": 6, "b": 3}, new_reqs=[new("a", 10, [0, 1, 2]), new("b", 3, [3])]))
    a, b = sampled(out)["a"], sampled(out)["b"]
    assert a == [] and len(b) == 1  # a's prompt is not done yet; b samples its first token
    assert r.requests["b"].output_token_ids == b
    out = r.execute(plan(2, {"a": 4, "b": 1}, cached_reqs=[cached("a", 6), cached("b", 3, [4])]))
    assert len(sampled(out)["a"]) == 1 and len(sampled(out)["b"]) == 1
    row = r.batch.req_id_to_index["b"]
    assert r.batch.token_ids[row, :5].tolist() == [10, 11, 12, *r.requests["b"].output_token_ids]
    r.execute(plan(3, {}, finished_req_ids=["a"]))
    assert "a" not in r.requests and r.batch.num_reqs == 1
    assert r.batch.req_id_to_index == {"b": 0}  # condensed


def test_preempt_and_resume_recompute(model_dir):
    r = runner(model_dir)
    r.execute(plan(1, {"a": 3}, new_reqs=[new("a", 3, [0])]))
    r.execute(plan(2, {"a": 1}, cached_reqs=[cached("a", 3, [1])]))
    outputs = list(r.requests["a"].output_token_ids)
    r.execute(plan(3, {}, preempted_req_ids=["a"]))
    assert "a" in r.requests and r.batch.num_reqs == 0  # keeps its state, leaves the batch
    out = r.execute(plan(4, {"a": 5}, cached_reqs=[cached("a", 0, [7, 8], resumed=True)]))
    assert r.requests["a"].block_ids == [7, 8]
    assert r.requests["a"].output_token_ids == [*outputs, *sampled(out)["a"]]
    # recomputing prompt + 2 outputs samples the third output, the same as without preemption
    r2 = runner(model_dir)
    r2.execute(plan(1, {"a": 3}, new_reqs=[new("a", 3, [0])]))
    r2.execute(plan(2, {"a": 1}, cached_reqs=[cached("a", 3, [1])]))
    r2.execute(plan(3, {"a": 1}, cached_reqs=[cached("a", 4)]))
    assert r2.requests["a"].output_token_ids == r.requests["a"].output_token_ids


def test_plan_n_plus_1_built_before_result_n(model_dir):
    """Async scheduling: step N+1 decodes at the position of the token step N sampled, which
    only this worker knows; it is already in the batch when N+1 runs."""
    r = runner(model_dir)
    first = sampled(r.execute(plan(1, {"a": 5}, new_reqs=[new("a", 5, [0, 1])])))["a"]
    row = r.batch.req_id_to_index["a"]
    assert r.batch.token_ids[row, 5] == first[0] and r.batch.num_tokens[row] == 6
    second = sampled(r.execute(plan(2, {"a": 1}, cached_reqs=[cached("a", 5)])))["a"]
    assert len(second) == 1 and r.requests["a"].output_token_ids == first + second
    key = np.array([request_key("a", None)], np.uint64)
    expected = sample_tokens(key, np.array([6]), np.array([True]), r.model_config, 0.0)
    assert second == expected.tolist()
    assert r.batch.num_computed_tokens[row] == 6 and r.batch.num_tokens[row] == 7


@pytest.mark.parametrize(
    "bad",
    [
        plan(2, {"x": 1}, cached_reqs=[cached("x", 0)]),  # unknown request
        plan(2, {"a": 2}, cached_reqs=[cached("a", 5)]),  # past the tokens it knows
        plan(2, {"c": 5}, new_reqs=[new("c", 5, [3])]),  # 5 tokens, KV slots for 4
    ],
)
def test_inconsistent_plans_raise(model_dir, bad):
    r = runner(model_dir)
    r.execute(plan(1, {"a": 5}, new_reqs=[new("a", 5, [0, 1])]))
    with pytest.raises((KeyError, ValueError)):
        r.execute(bad)


def test_tokens_are_deterministic_and_avoid_eos(model_dir):
    def generate(req_id: str, seed: int | None = None) -> list[int]:
        r = runner(model_dir)
        r.execute(plan(1, {req_id: 4}, new_reqs=[new(req_id, 4, [0, 1, 2, 3], seed=seed)]))
        for step in range(2, 10):
            r.execute(plan(step, {req_id: 1}, cached_reqs=[cached(req_id, 2 + step)]))
        return r.requests[req_id].output_token_ids

    assert generate("a") == generate("a") != generate("b")
    assert generate("a", seed=5) == generate("b", seed=5) != generate("b", seed=6)
    keys = np.repeat(np.arange(500, dtype=np.uint64) * 7919, 40)
    tokens = sample_tokens(
        keys,
        np.tile(np.arange(40), 500),
        np.ones(20000, bool),
        ModelConfig.from_dir(model_dir),
        0.0,
    )
    assert not np.isin(tokens, EOS).any() and len(np.unique(tokens)) == VOCAB - len(EOS)


def test_eos_rate_and_min_tokens(model_dir):
    info = ModelConfig.from_dir(model_dir)
    keys = np.array([request_key(f"r{i}", None) for i in range(400)], np.uint64).repeat(50)
    positions = np.tile(np.arange(50), 400)
    allowed = positions >= 10
    tokens = sample_tokens(keys, positions, allowed, info, 0.3)
    assert not (tokens[~allowed] == EOS[0]).any()
    assert (tokens[allowed] == EOS[0]).mean() == pytest.approx(0.3, abs=0.02)
    # through the runner: min_tokens outputs first, then EOS (rate 1)
    r = runner(model_dir, eos_rate=1.0)
    r.execute(plan(1, {"a": 2}, new_reqs=[new("a", 2, [0, 1, 2], min_tokens=3)]))
    for step in range(2, 5):
        r.execute(plan(step, {"a": 1}, cached_reqs=[cached("a", step)]))
    outputs = r.requests["a"].output_token_ids
    assert len(outputs) == 4 and outputs[3] == EOS[0] and EOS[0] not in outputs[:3]


def test_logprobs_and_prompt_logprobs_in_the_runner_shape(model_dir):
    r = runner(model_dir)
    req = new("a", 7, [0, 1], logprobs=2, prompt_logprobs=1)
    first = r.execute(plan(1, {"a": 4, "b": 2}, new_reqs=[req, new("b", 2, [2])]))
    assert first.logprobs == []  # a still in prefill; b samples but did not ask
    second = r.execute(plan(2, {"a": 3}, cached_reqs=[cached("a", 4)]))
    (lp,) = second.logprobs
    assert lp.token_ids[:2] == second.sampled_token_ids[0] * 2 and len(lp.token_ids) == 3
    assert lp.rank == 1 and lp.logprobs[0] == lp.logprobs[1] >= lp.logprobs[2]
    assert all(v <= 0 for v in lp.logprobs)
    parts = first.prompt_logprobs["a"] + second.prompt_logprobs["a"]
    assert len(parts) == 7 and parts[0] is None  # one entry per prompt token, in two parts
    prompt = req.prompt_token_ids
    assert [p.token_ids[0] for p in parts[1:]] == prompt[1:]
    assert all(len(p.token_ids) == 2 and p.rank == 1 for p in parts[1:])
    third = r.execute(plan(3, {"a": 1}, cached_reqs=[cached("a", 7)]))
    assert third.prompt_logprobs == {} and third.logprobs[0] is not None


def test_step_time_model(model_dir):
    sim = SimConfig(sim_step_base_ms=4.0, sim_per_token_us=100.0, sim_per_req_us=500.0)
    r = SimRunner(RunnerConfig(model_dir=str(model_dir), block_size=BS, num_blocks=64), sim)
    p = plan(1, {"a": 5, "b": 3}, new_reqs=[new("a", 5, [0, 1]), new("b", 3, [2])])
    assert r.step_time_s(p) == pytest.approx(0.004 + 8 * 100e-6 + 2 * 500e-6)
    assert r.step_time_s(plan(2, {}, finished_req_ids=["a"])) == 0.0

    async def timed() -> float:
        t0 = time.perf_counter()
        await r.step(p)
        return time.perf_counter() - t0

    assert 0.0057 <= asyncio.run(timed()) < 0.5


def test_sim_config_rejects_bad_values():
    with pytest.raises(ValueError):
        SimConfig(sim_eos_rate=1.5)
    with pytest.raises(ValueError):
        SimConfig(sim_per_token_us=-1)


def test_count_needs_the_sim_device():
    from services.worker.main import serve

    with pytest.raises(SystemExit):
        asyncio.run(serve(["--count", "2", "--device", "cpu", "--model", "/nonexistent"]))


def test_the_sim_path_imports_no_torch(model_dir):
    code = (
        "import sys\n"
        "import services.worker.main\n"
        "from services.worker.config import RunnerConfig, SimConfig\n"
        "from services.worker.sim_runner import SimRunner\n"
        f"SimRunner(RunnerConfig(model_dir={str(model_dir)!r}), SimConfig())\n"
        "assert 'torch' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


def test_service_runs_sim_steps_on_the_loop_and_resets_on_a_bad_plan(model_dir, nats_url):
    """Over a real nats-server: results carry the modelled execute_s; a plan the runner cannot
    apply makes the worker come back as a new instance."""

    async def run() -> None:
        sim = SimConfig(sim_step_base_ms=20.0)
        config = RunnerConfig(model_dir=str(model_dir), block_size=BS, num_blocks=64)
        service = WorkerService(
            WorkerServiceConfig(nats_url=nats_url, worker_id="sim-0"), SimRunner(config, sim)
        )
        assert service.executor is None  # no thread of its own
        nc = await bus.connect(nats_url, "test")
        hellos: asyncio.Queue[WorkerHello] = asyncio.Queue()
        results: asyncio.Queue[ModelRunnerOutput] = asyncio.Queue()
        subjects = Subjects()
        await bus.subscribe(nc, subjects.worker_hello("*"), WorkerHello, hellos.put)
        await bus.subscribe(nc, subjects.result("*"), ModelRunnerOutput, results.put)
        await bus.flush(nc)
        await service.start()
        hello = await asyncio.wait_for(hellos.get(), 5)
        assert (hello.device, hello.num_blocks, hello.vocab_size) == ("sim", 64, VOCAB)
        assert hello.eos_token_ids == list(EOS)
        good = plan(1, {"a": 3}, new_reqs=[new("a", 3, [0])], worker_session="s")
        await bus.publish(nc, subjects.plan("sim-0"), good)
        out = await asyncio.wait_for(results.get(), 5)
        assert out.worker_id == "sim-0" and len(out.sampled_token_ids[0]) == 1
        assert out.execute_s >= 0.02
        assert out.idle_s > 0  # it waited for this plan since it started
        bad = plan(2, {"x": 1}, cached_reqs=[cached("x", 0)], worker_session="s")
        await bus.publish(nc, subjects.plan("sim-0"), bad)
        again = await asyncio.wait_for(hellos.get(), 5)
        assert again.instance_id != hello.instance_id and service.runner.requests == {}
        # a plan of the failed session, sent before the scheduler knew: skipped, not a failure
        stale = plan(3, {"a": 1}, cached_reqs=[cached("a", 3)], worker_session="s")
        await bus.publish(nc, subjects.plan("sim-0"), stale)
        fresh = plan(4, {"b": 2}, new_reqs=[new("b", 2, [1])], worker_session="s2")
        await bus.publish(nc, subjects.plan("sim-0"), fresh)
        out = await asyncio.wait_for(results.get(), 5)
        assert out.step_id == 4 and hellos.empty()
        await service.stop()
        await nc.drain()

    asyncio.run(run())


def test_serve_starts_every_simulated_worker_in_one_process():
    from services.cli import build_serve_parser, stack_config
    from services.launcher import Stack
    from services.worker.main import build_parser as worker_parser

    argv = ["--worker-device", "sim", "--workers", "3", "--sim-eos-rate", "0.25"]
    parser = build_serve_parser()
    args, configs = parser.parse_configs(argv)
    stack = Stack(stack_config(parser, args, configs, "/m"))
    spawned: dict[str, list[str]] = {}
    stack._spawn = lambda name, argv: spawned.setdefault(name, argv[3:])  # type: ignore[method-assign]
    stack.start_sim_workers()
    ns, worker = worker_parser().parse_configs(spawned["sim-workers"])
    assert (ns.device, ns.count, ns.model) == ("sim", 3, "/m")
    assert worker[WorkerServiceConfig].worker_id == "worker"  # worker-0, worker-1, worker-2
    assert worker[SimConfig] == SimConfig(sim_eos_rate=0.25)
