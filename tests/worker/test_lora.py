"""LoRA adapters in the model runner, on the embedded SmolLM2 with random PEFT adapters of rank
8 and 16: greedy output with an adapter equals transformers + peft with the adapter merged
into the weights, token for token; base requests in the same batch equal the base model's;
a request's tokens do not depend on which adapters share its batch; slots are reused least
recently used first; a request whose adapter cannot run fails alone (failed_reqs)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from services.worker.config import RunnerConfig, SimConfig, WorkerServiceConfig
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import ModelRunner
from services.worker.service import WorkerService
from services.worker.sim_runner import SimRunner
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, CachedRequestData, LoRARequest, NewRequestData
from tests.lora_adapters import ALL_PROJECTIONS, assert_greedy, base_model, make_adapters

NUM_TOKENS = 16
BLOCKS_PER_REQ = 4  # 64 tokens of 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
# name -> LoraConfig arguments: rank 8 on every projection; rank 16 with rsLoRA on some of
# them in half the layers; rank 8 on q/k/up through PEFT's regex form
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL_PROJECTIONS},
    "r16": {
        "r": 16,
        "lora_alpha": 32,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"],
        "layers_to_transform": list(range(0, 30, 2)),
    },
    "r8-qk-up": {"r": 8, "lora_alpha": 16, "target_modules": r".*\.(q_proj|k_proj|up_proj)"},
}


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory) -> dict[str, tuple[LoRARequest | None, Any]]:
    """Each adapter and transformers' model with it merged; "base": the base model."""
    base = base_model(smollm2_dir)
    made = make_adapters(base, tmp_path_factory.mktemp("adapters"), ADAPTERS)
    return {"base": (None, base), **made}


@pytest.fixture(scope="module")
def runner(smollm2_dir) -> ModelRunner:
    config = RunnerConfig(
        model_dir=str(smollm2_dir),
        num_blocks=8 * BLOCKS_PER_REQ,
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
    )
    return ModelRunner(config)


class Driver:
    """Runs requests to NUM_TOKENS greedy tokens through hand-built plans and finishes them:
    request i joins at step `starts[i]` (default: all at once), its prompt in chunks of
    `chunk` tokens (default: whole), then one token a step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.num_reqs = 0

    def execute(self, **fields: Any) -> Any:
        self.step_id += 1
        return self.runner.execute(BatchPlan(step_id=self.step_id, **fields))

    def generate(
        self,
        reqs: list[tuple[list[int], LoRARequest | None]],
        starts: list[int] | None = None,
        chunk: int = 1 << 30,
        params: SamplingParams | None = None,
    ) -> list[list[int]]:
        ids = [f"req-{self.num_reqs + i}" for i in range(len(reqs))]
        self.num_reqs += len(reqs)
        starts = starts or [0] * len(reqs)
        computed = dict.fromkeys(ids, 0)
        tokens: dict[str, list[int]] = {req_id: [] for req_id in ids}
        try:
            for step in range(10 * NUM_TOKENS):
                new, cached, sched = [], [], {}
                for i, (req_id, (prompt, lora)) in enumerate(zip(ids, reqs, strict=True)):
                    if step < starts[i] or len(tokens[req_id]) == NUM_TOKENS:
                        continue
                    left = len(prompt) - computed[req_id]
                    sched[req_id] = min(chunk, left) if left > 0 else 1
                    if step == starts[i]:
                        new.append(self._new(req_id, prompt, lora, i, params))
                    else:
                        cached.append(
                            CachedRequestData(
                                req_id=req_id,
                                new_block_ids=[],
                                num_computed_tokens=computed[req_id],
                            )
                        )
                if not sched:
                    break
                out = self.execute(new_reqs=new, cached_reqs=cached, num_scheduled_tokens=sched)
                for req_id, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
                    computed[req_id] += sched[req_id]
                    tokens[req_id] += sampled
        finally:
            self.execute(finished_req_ids=ids)
        assert all(len(t) == NUM_TOKENS for t in tokens.values())
        return [tokens[req_id] for req_id in ids]

    @staticmethod
    def _new(
        req_id: str,
        prompt: list[int],
        lora: LoRARequest | None,
        i: int,
        params: SamplingParams | None = None,
    ) -> NewRequestData:
        return NewRequestData(
            req_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=params or SamplingParams(temperature=0.0),
            block_ids=list(range(i * BLOCKS_PER_REQ, (i + 1) * BLOCKS_PER_REQ)),
            num_computed_tokens=0,
            lora=lora,
        )


@pytest.fixture(scope="module")
def driver(runner) -> Driver:
    return Driver(runner)


def run(driver: Driver, adapters: dict, reqs: list[tuple[list[int], str]]) -> list[list[int]]:
    """Each (prompt, adapter name) request's tokens from one batch, each checked against
    transformers with the adapter merged."""
    outputs = driver.generate([(prompt, adapters[name][0]) for prompt, name in reqs])
    for (prompt, name), tokens in zip(reqs, outputs, strict=True):
        assert_greedy(adapters[name][1], prompt, tokens)
    return outputs


@pytest.mark.parametrize("name", ["r8", "r16"])
def test_an_adapter_generates_what_its_merged_weights_do(driver, prompts, adapters, name):
    (tokens,) = run(driver, adapters, [(prompts[0], name)])
    (base,) = run(driver, adapters, [(prompts[0], "base")])
    assert tokens != base  # the adapter changes the output


def test_adapters_and_the_base_model_share_a_batch(driver, prompts, adapters):
    """Base, r8 and r16 requests in one batch (r8 twice): each gets its reference's tokens,
    the same as alone or with other adapters."""
    p0, p1, p2 = prompts
    mixed = run(driver, adapters, [(p0, "base"), (p1, "r8"), (p2, "r16"), (p2, "r8")])
    alone = [run(driver, adapters, [req])[0] for req in [(p0, "base"), (p1, "r8"), (p2, "r16")]]
    assert mixed[:3] == alone
    assert run(driver, adapters, [(p2, "r8"), (p1, "base")])[0] == mixed[3]
    assert run(driver, adapters, [(p2, "base")])[0] not in (mixed[2], mixed[3])


def test_seeded_sampling_does_not_depend_on_the_adapters_sharing_the_batch(
    driver, prompts, adapters
):
    """A seeded, sampled request of r8 gets the same tokens alone and beside an r16 and a
    base request; so does the base request."""
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    p0, p1, p2 = prompts
    r8, r16 = adapters["r8"][0], adapters["r16"][0]
    (alone,) = driver.generate([(p1, r8)], params=seeded)
    (base_alone,) = driver.generate([(p2, None)], params=seeded)
    mixed = driver.generate([(p0, r16), (p1, r8), (p2, None)], params=seeded)
    assert mixed[1:] == [alone, base_alone]
    assert alone != driver.generate([(p1, r8)])[0]  # it samples: not the greedy tokens


def test_adapter_prefill_chunks_share_steps_with_other_decodes(driver, prompts, adapters):
    """Requests joining one after the other, prompts in chunks of 3: steps mix one adapter's
    prefill chunk with other adapters' and the base model's decode tokens."""
    p0, p1, p2 = prompts
    reqs = [(p0, "r8"), (p1, "base"), (p2, "r16"), (p1, "r8")]
    outputs = driver.generate(
        [(prompt, adapters[name][0]) for prompt, name in reqs], starts=[0, 2, 3, 5], chunk=3
    )
    for (prompt, name), tokens in zip(reqs, outputs, strict=True):
        assert_greedy(adapters[name][1], prompt, tokens)


def test_slots_are_reused_least_recently_used_first(driver, runner, prompts, adapters):
    """Two slots, three adapters: each one loaded evicts the least recently used adapter of
    no request in the step; a slot reused by an adapter of fewer modules keeps nothing of
    the one before."""
    p0, p1, p2 = prompts
    assert runner.lora is not None
    slots = runner.lora.slots
    run(driver, adapters, [(p0, "r16"), (p1, "r8")])
    assert slots.names() == ["r16", "r8"]
    qk = run(driver, adapters, [(p1, "r8-qk-up")])  # into r16's slot
    assert slots.names() == ["r8", "r8-qk-up"]
    assert qk != run(driver, adapters, [(p1, "base")])
    run(driver, adapters, [(p2, "r16"), (p0, "r8-qk-up")])  # r16 into r8's slot
    assert slots.names() == ["r16", "r8-qk-up"]


def run_failing_step(
    driver: Driver, reqs: list[tuple[list[int], LoRARequest | None]]
) -> tuple[dict[int, str], list[list[int] | None]]:
    """One step of the prompts, then two decode steps that still schedule every request (as
    plans sent before the scheduler heard of a failure do), then finish them all; the step's
    failed requests (by index) and every request's tokens (None: it failed)."""
    ids = [f"req-{driver.num_reqs + i}" for i in range(len(reqs))]
    driver.num_reqs += len(reqs)
    new = [
        Driver._new(r, p, lora, i) for i, (r, (p, lora)) in enumerate(zip(ids, reqs, strict=True))
    ]
    out = driver.execute(
        new_reqs=new, num_scheduled_tokens={r: len(p) for r, (p, _) in zip(ids, reqs, strict=True)}
    )
    failed = dict(out.failed_reqs)
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}
    for _ in range(2):
        cached = [
            CachedRequestData(
                req_id=r, new_block_ids=[], num_computed_tokens=len(p) + len(tokens.get(r, [])) - 1
            )
            for r, (p, _) in zip(ids, reqs, strict=True)
        ]
        out = driver.execute(cached_reqs=cached, num_scheduled_tokens=dict.fromkeys(ids, 1))
        assert not out.failed_reqs and set(out.req_ids) == set(tokens)
        for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
            tokens[r] += t
    driver.execute(finished_req_ids=ids)
    return {ids.index(r): reason for r, reason in failed.items()}, [tokens.get(r) for r in ids]


def test_the_worker_metrics_count_loads_evictions_and_slots(driver, runner, prompts, adapters):
    assert runner.lora is not None
    metrics = WorkerMetrics("m")
    metrics.worker("w", lambda: True).watch_lora(runner)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"worker_id": "w", **labels})

    loads, evictions = (
        value("skiff_worker_lora_loads_total"),
        value("skiff_worker_lora_evictions_total"),
    )
    held = runner.lora.slots.names()
    new = next(name for name in ADAPTERS if name not in held)  # evicts one of two held
    run(driver, adapters, [(prompts[0], new)])
    assert value("skiff_worker_lora_loads_total") == loads + 1
    assert value("skiff_worker_lora_evictions_total") == evictions + (len(held) == 2)
    assert value("skiff_worker_lora_load_seconds_total") > 0
    assert value("skiff_worker_lora_slots", state="used") == 2
    assert value("skiff_worker_lora_slots", state="free") == 0


def test_a_step_of_more_adapters_than_slots_fails_only_the_extra_request(
    driver, runner, prompts, adapters
):
    """The scheduler never plans more adapters than slots; should a plan do so anyway, the
    requests of the adapters beyond them fail (their reason in failed_reqs), the others run
    on, also through plans that still schedule the failed ones."""
    reqs = [(prompts[0], adapters[name][0]) for name in ADAPTERS]
    failed, tokens = run_failing_step(driver, reqs)
    assert list(failed) == [2] and "more adapters than this worker's max_loras 2" in failed[2]
    assert tokens[2] is None
    for name, prompt_tokens in zip(ADAPTERS, tokens[:2], strict=False):
        assert_greedy(adapters[name][1], prompts[0], prompt_tokens)
    assert not runner._failed_req_ids  # forgotten once a plan finished them
    run(driver, adapters, [(prompts[0], "r8")])


def test_an_adapter_that_fails_to_load_fails_its_request_and_holds_no_slot(
    driver, runner, prompts, adapters, tmp_path
):
    assert runner.lora is not None
    bad = LoRARequest(lora_name="missing", lora_path=str(tmp_path / "nowhere"))
    failed, tokens = run_failing_step(driver, [(prompts[0], adapters["r8"][0]), (prompts[1], bad)])
    assert list(failed) == [1] and "LoRA adapter missing: no adapter_config.json in" in failed[1]
    assert_greedy(adapters["r8"][1], prompts[0], tokens[0])
    assert "missing" not in runner.lora.slots and "r8" in runner.lora.slots


def test_an_adapter_read_again_from_a_new_directory(driver, runner, prompts, adapters):
    """A name loaded again from another directory (unloaded, then loaded anew) is read
    again: r8's name with r16's weights generates r16's tokens."""
    r16 = adapters["r16"][0]
    renamed = LoRARequest(lora_name="r8", lora_path=r16.lora_path)
    (tokens,) = driver.generate([(prompts[2], renamed)])
    assert_greedy(adapters["r16"][1], prompts[2], tokens)
    (tokens,) = driver.generate([(prompts[2], adapters["r8"][0])])
    assert_greedy(adapters["r8"][1], prompts[2], tokens)


def test_loading_an_adapter_takes_well_under_a_second(runner, adapters):
    """Rank 16 (on 4 projections of 15 layers): about 10 ms on an idle core."""
    assert runner.lora is not None
    lora = adapters["r16"][0]
    start = time.perf_counter()
    runner.lora.load(LoRARequest(lora_name="r16-again", lora_path=lora.lora_path), step=())
    assert time.perf_counter() - start < 1.0
    assert "r16-again" in runner.lora.slots


def test_a_worker_without_lora_fails_an_adapter_request(tiny_models, tmp_path):
    runner = ModelRunner(
        RunnerConfig(model_dir=str(tiny_models["llama"]), num_blocks=8, max_model_len=64)
    )
    assert runner.lora is None
    new = NewRequestData(
        req_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=[0],
        num_computed_tokens=0,
        lora=LoRARequest(lora_name="sql", lora_path=str(tmp_path)),
    )
    out = runner.execute(BatchPlan(step_id=0, new_reqs=[new], num_scheduled_tokens={"r": 3}))
    assert out.req_ids == [] and out.failed_reqs == {
        "r": "LoRA adapter sql: this worker runs without --enable-lora"
    }


@pytest.mark.parametrize(("enable", "announced"), [(False, (0, 0)), (True, (3, 8))])
def test_the_hello_announces_the_lora_slots(smollm2_dir: Path, enable, announced):
    config = RunnerConfig(
        model_dir=str(smollm2_dir), device="sim", enable_lora=enable, max_loras=3, max_lora_rank=8
    )
    service = WorkerService(WorkerServiceConfig(worker_id="w-lora"), SimRunner(config, SimConfig()))
    hello = service.hello()
    assert (hello.max_loras, hello.max_lora_rank) == announced
