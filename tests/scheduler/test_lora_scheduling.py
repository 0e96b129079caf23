"""LoRA adapters on the scheduler side: the registry, admission by adapter name, a worker's
adapter limit per step, prefix caching per adapter and adapter-aware placement."""

from __future__ import annotations

import pytest

from services.scheduler.admission import Admission
from services.scheduler.lora_registry import LoRARegistry, LoRARegistryError, parse_lora_modules
from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_pool import LORA_LOAD_COST_TOKENS, WorkerPool
from shared.config import SchedulerConfig
from shared.prefix_hash import ROOT_HASH, prefix_root
from shared.sampling_params import SamplingParams
from shared.wire import LoRARequest, ModelRunnerOutput, SubmitRequest
from tests.scheduler.fakes import make_hello, unpaced_config

A = LoRARequest(lora_name="a", lora_path="/adapters/a")
B = LoRARequest(lora_name="b", lora_path="/adapters/b")


def request(req_id: str, lora: LoRARequest | None, tokens: list[int] | None = None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return Request(req_id, tokens or list(range(100, 120)), params, lora=lora)


def core(max_loras: int, **kw) -> Scheduler:
    config = SchedulerConfig(block_size=16, max_loras=max_loras, **kw)
    return Scheduler(config, num_blocks=64, eos_token_ids=(2,))


def finish(s: Scheduler, plan) -> None:
    """Fake worker: every scheduled request samples EOS once its prompt is computed."""
    ids = list(plan.num_scheduled_tokens)
    sampled = [
        [2] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids
    ]
    s.update(ModelRunnerOutput(step_id=plan.step_id, req_ids=ids, sampled_token_ids=sampled))


def test_lora_modules_parse_and_refuse_bad_items():
    assert parse_lora_modules("a=/x b=/y,c=rel") == {"a": "/x", "b": "/y", "c": "rel"}
    assert parse_lora_modules("") == {}
    for bad in ("a", "=x", "a=", "a=/x a=/y", "bad name=/x", ".a=/x"):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)


def test_runtime_loads_stay_under_the_root():
    registry = LoRARegistry({"a": "/adapters/a"}, root="/srv/loras", reserved="base")
    assert registry.resolve("b", "b") == LoRARequest(
        lora_name="b", lora_path="/srv/loras/b", root="/srv/loras"
    )
    assert registry.resolve("c", "/srv/loras/x/../c").lora_path == "/srv/loras/c"
    for name, path, status in (
        ("d", "../etc", 400),
        ("d", "/srv/lorasX/d", 400),
        ("d", "/etc/passwd", 400),
        ("a", "a2", 400),  # taken
        ("base", "base", 400),  # the base model's name
        ("bad name", "x", 400),
    ):
        with pytest.raises(LoRARegistryError) as err:
            registry.resolve(name, path)
        assert err.value.status == status, (name, path)
    with pytest.raises(LoRARegistryError) as err:
        LoRARegistry({}).resolve("b", "b")
    assert err.value.status == 403  # no root: runtime loading off
    with pytest.raises(LoRARegistryError) as err:
        registry.remove("zzz")
    assert err.value.status == 404
    assert registry.remove("a").lora_name == "a" and registry.names == []


def test_admission_knows_adapters_by_name():
    pool = WorkerPool(SchedulerConfig())
    pool.register(make_hello(max_loras=2))
    registry = LoRARegistry({"a": "/adapters/a"})
    admission = Admission(pool, Placement(pool, lambda _: None), 8, registry)

    def submit(name):
        return SubmitRequest(
            req_id="r",
            gateway_id="g",
            prompt_token_ids=[1, 2],
            sampling_params=SamplingParams(),
            lora_name=name,
        )

    assert admission.check(submit("a")).accepted
    reply = admission.check(submit("nope"))
    assert (reply.status, reply.param) == (404, "model") and "nope" in reply.message
    no_lora = WorkerPool(SchedulerConfig())
    no_lora.register(make_hello())
    reply = Admission(no_lora, Placement(no_lora, lambda _: None), 8, registry).check(submit("a"))
    assert reply.status == 503 and "--enable-lora" in reply.message


def test_a_step_holds_at_most_max_loras_adapters_and_base_requests_pass():
    s = core(max_loras=1)
    for req_id, lora in (("a1", A), ("b1", B), ("base", None), ("a2", A)):
        s.add_request(request(req_id, lora, list(range(100 + len(req_id), 120))))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"a1", "base", "a2"}  # b1 waits for a's slot
    assert {r.req_id: r.lora for r in plan.new_reqs} == {"a1": A, "base": None, "a2": A}
    finish(s, plan)
    plan = s.schedule()
    assert list(plan.num_scheduled_tokens) == ["b1"] and plan.new_reqs[0].lora == B
    assert list(s.resident_loras) == ["b"]


def test_waiting_order_is_kept_past_a_skipped_adapter():
    s = core(max_loras=1, max_num_seqs=2)
    for req_id, lora in (("a1", A), ("b1", B), ("b2", B), ("a2", A)):
        s.add_request(request(req_id, lora))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"a1", "a2"}
    assert [r.req_id for r in s.waiting] == ["b1", "b2"]


def test_adapters_do_not_share_prefix_cache_blocks():
    s = core(max_loras=2)
    tokens = list(range(100, 164))  # four full blocks
    s.add_request(request("a", A, tokens))
    finish(s, s.schedule())
    assert s.kv.num_cached_prefix_blocks(tokens, prefix_root("a")) == 4
    assert s.kv.num_cached_prefix_blocks(tokens) == 0
    assert s.kv.num_cached_prefix_blocks(tokens, prefix_root("b")) == 0
    s.add_request(request("a-again", A, tokens))
    s.add_request(request("b", B, tokens))
    s.schedule()
    assert s.requests["a-again"].num_cached_tokens == 48
    assert s.requests["b"].num_cached_tokens == 0
    assert prefix_root(None) == ROOT_HASH != prefix_root("a") != prefix_root("b")


def test_a_request_with_an_adapter_goes_only_to_workers_with_lora():
    pool = WorkerPool(unpaced_config())
    pool.register(make_hello("plain"))
    lora_worker, _ = pool.register(make_hello("lora", max_loras=2))
    assert pool.select(request("r", A)) is lora_worker
    with pytest.raises(ValueError, match="LoRA"):
        pool.workers["plain"].core.add_request(request("x", A))
    only_plain = WorkerPool(unpaced_config())
    only_plain.register(make_hello("plain"))
    with pytest.raises(LookupError):
        only_plain.select(request("r", A))


def test_placement_prefers_the_worker_that_holds_the_adapter_unless_it_is_much_busier():
    pool = WorkerPool(unpaced_config())
    warm, _ = pool.register(make_hello("warm", max_loras=1))
    cold, _ = pool.register(make_hello("cold", max_loras=1))
    warm.core.add_request(request("first", A))
    finish(warm.core, warm.core.schedule())
    assert list(warm.core.resident_loras) == ["a"]
    assert pool.select(request("next", A, list(range(300, 310)))) is warm
    assert pool.select(request("other", B, list(range(300, 310)))) in (warm, cold)
    # the warm worker gets busier than loading the adapter elsewhere costs
    busy = list(range(500, 500 + LORA_LOAD_COST_TOKENS + 64))
    warm.core.add_request(request("busy", None, busy))
    assert pool.select(request("next2", A, list(range(300, 310)))) is cold
