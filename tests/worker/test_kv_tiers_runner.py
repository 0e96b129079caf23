"""KV tiers in the model runner and the worker: a prompt's blocks offloaded, dropped from the
device and loaded back into other blocks (from this worker's host or disk tier, or fetched
from another worker's KV-transfer server) decode the same greedy tokens as without the round
trip; the server refuses fetches for an instance the worker no longer is."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from services.worker.config import RunnerConfig, WorkerServiceConfig
from services.worker.kv_tiers.blocks import gather_blocks
from services.worker.kv_tiers.slots import num_tier_blocks
from services.worker.kv_transfer import KVTransferError, TcpTransport, TransferServer
from services.worker.model_runner import ModelRunner
from services.worker.service import WorkerService
from shared.sampling_params import SamplingParams
from shared.wire import (
    KV_DEVICE,
    KV_DISK,
    KV_HOST,
    BatchPlan,
    CachedRequestData,
    KVCopy,
    KVLoad,
    NewRequestData,
)

BS = 4
PROMPT = [5, 17, 42, 8, 99, 3, 64, 71, 12, 150, 33, 7, 88]  # 13 tokens: 3 full blocks + 1
CACHED = 12  # tokens in the 3 full blocks
DECODE = 5  # tokens after the first: 18 positions computed in all, 5 blocks


def runner(model_dir: Path, disk_dir: Path | None = None) -> ModelRunner:
    tiers: dict[str, float | str] = {}
    if disk_dir is not None:
        block_bytes = 2 * 2 * BS * 2 * 16 * 4  # layers, K/V, tokens, kv heads, head dim, fp32
        tiers = {
            "kv_offloading_size": 8 * block_bytes / 2**30,
            "kv_offloading_disk_size": 8 * block_bytes / 2**30,
            "kv_offloading_disk_path": str(disk_dir),
        }
    config = RunnerConfig(
        model_dir=str(model_dir), num_blocks=16, block_size=BS, max_model_len=256, **tiers
    )
    r = ModelRunner(config)
    if disk_dir is not None:
        assert r.kv_tiers.block_bytes == block_bytes
        assert r.kv_tiers.stats.num_host_blocks == num_tier_blocks(
            config.kv_offloading_size, block_bytes
        )
    return r


def new(req_id: str, blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=PROMPT,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=DECODE + 1),
        block_ids=blocks,
        num_computed_tokens=computed,
    )


def generate(r: ModelRunner, req_id: str, step: int) -> list[int]:
    """Greedy tokens of `req_id` (its prompt computed up to CACHED): the prompt's last token,
    then DECODE more."""
    tokens: list[int] = []
    for i in range(DECODE + 1):
        computed = CACHED + i
        cached = CachedRequestData(req_id=req_id, new_block_ids=[], num_computed_tokens=computed)
        out = r.execute(
            BatchPlan(step_id=step + i, cached_reqs=[cached], num_scheduled_tokens={req_id: 1})
        )
        tokens += out.sampled_token_ids[0]
    return tokens


def prefill(r: ModelRunner, req_id: str, blocks: list[int]) -> None:
    """The prompt's first CACHED tokens into `blocks` (nothing sampled yet)."""
    out = r.execute(
        BatchPlan(step_id=1, new_reqs=[new(req_id, blocks)], num_scheduled_tokens={req_id: CACHED})
    )
    assert out.sampled_token_ids == [[]]


def continue_from_loaded(r: ModelRunner, blocks: list[int]) -> list[int]:
    """A new request whose first CACHED tokens are in `blocks` (loaded), then two more
    blocks."""
    out = r.execute(BatchPlan(step_id=20, new_reqs=[new("b", [*blocks, 14, 15], computed=CACHED)]))
    assert out.req_ids == []
    return generate(r, "b", 21)


@pytest.fixture(scope="module")
def reference(tiny_models) -> list[int]:
    r = runner(tiny_models["llama"])
    prefill(r, "r", [0, 1, 2, 3, 4])
    tokens = generate(r, "r", 2)
    assert len(tokens) == DECODE + 1
    return tokens


def offload(r: ModelRunner) -> torch.Tensor:
    """Finish the prefilled request, copy its blocks 0-2 to host slots 0-2 and these to disk
    slots 4, 3, 2; zero the device pool; returns the blocks as they were."""
    before = gather_blocks(r.kv_caches, torch.tensor([0, 1, 2]))
    copies = [
        KVCopy(KV_DEVICE, KV_HOST, [0, 1, 2], [0, 1, 2]),
        KVCopy(KV_HOST, KV_DISK, [0, 1, 2], [4, 3, 2]),
    ]
    r.execute(BatchPlan(step_id=10, finished_req_ids=["a"], kv_copies=copies))
    for kv in r.kv_caches:
        kv.zero_()
    return before


@pytest.mark.parametrize(("tier", "src"), [(KV_HOST, [0, 1, 2]), (KV_DISK, [4, 3, 2])])
def test_offloaded_and_loaded_back_blocks_decode_the_same_tokens(
    tiny_models, tmp_path, reference, tier, src
):
    r = runner(tiny_models["llama"], tmp_path)
    try:
        prefill(r, "a", [0, 1, 2, 3])
        before = offload(r)
        load = KVLoad(load_id=3, block_ids=[9, 7, 8], src_tier=tier, src=src)
        out = r.execute(BatchPlan(step_id=11, kv_loads=[load]))
        assert out.kv_loads_done == [3] and out.kv_loads_failed == []
        assert out.kv_load_bytes == 3 * r.kv_tiers.block_bytes
        assert torch.equal(gather_blocks(r.kv_caches, torch.tensor([9, 7, 8])), before)
        assert continue_from_loaded(r, [9, 7, 8]) == reference
    finally:
        r.close()
    assert list(tmp_path.iterdir()) == []  # the disk tier's file is gone


def test_a_plan_loads_while_its_forward_pass_runs(tiny_models, tmp_path, reference):
    """Loads into free blocks ride in the same plan as another request's steps."""
    r = runner(tiny_models["llama"], tmp_path)
    try:
        prefill(r, "a", [0, 1, 2, 3])
        offload(r)
        prefill(r, "c", [10, 11, 12, 13])
        load = KVLoad(load_id=1, block_ids=[5, 6, 7], src_tier=KV_DISK, src=[4, 3, 2])
        cached = CachedRequestData(req_id="c", new_block_ids=[], num_computed_tokens=CACHED)
        out = r.execute(
            BatchPlan(
                step_id=12, cached_reqs=[cached], num_scheduled_tokens={"c": 1}, kv_loads=[load]
            )
        )
        assert out.kv_loads_done == [1] and out.sampled_token_ids == [[reference[0]]]
        assert continue_from_loaded(r, [5, 6, 7]) == reference
    finally:
        r.close()


@pytest.mark.parametrize(
    ("tier", "src"), [(KV_DEVICE, [0, 1, 2]), (KV_HOST, [0, 1, 2]), (KV_DISK, [4, 3, 2])]
)
def test_blocks_fetched_from_another_worker_decode_the_same_tokens(
    tiny_models, tmp_path, reference, tier, src
):
    source, dest = runner(tiny_models["llama"], tmp_path), runner(tiny_models["llama"])
    server = TransferServer(source.kv_tiers.block_source(), "inst-a")
    server.start()
    try:
        prefill(source, "a", [0, 1, 2, 3])
        if tier != KV_DEVICE:
            offload(source)
        load = KVLoad(
            load_id=4,
            block_ids=[9, 7, 8],
            src_tier=tier,
            src=src,
            remote_address=server.address,
            remote_instance_id="inst-a",
        )
        out = dest.execute(BatchPlan(step_id=11, kv_loads=[load]))
        assert out.kv_loads_done == [4] and out.kv_load_bytes == 3 * dest.kv_tiers.block_bytes
        assert server.bytes_served >= out.kv_load_bytes
        assert dest.kv_tiers.stats.load_bytes == {"remote": out.kv_load_bytes}
        assert 0 < dest.kv_tiers.stats.read_seconds()["remote"] <= out.kv_load_s
        assert continue_from_loaded(dest, [9, 7, 8]) == reference
        gone = KVLoad(**{**_fields(load), "load_id": 5, "remote_instance_id": "inst-b"})
        out = dest.execute(BatchPlan(step_id=40, kv_loads=[gone]))
        assert out.kv_loads_failed == [5] and dest.kv_tiers.stats.load_failures == {"transfer": 1}
    finally:
        server.close()
        source.close()
        dest.close()


def _fields(load: KVLoad) -> dict[str, object]:
    return {f: getattr(load, f) for f in load.__struct_fields__}


def test_the_worker_serves_its_current_instance_only(tiny_models):
    r = runner(tiny_models["llama"])
    config = WorkerServiceConfig(worker_id="w-kv", kv_transfer_advertise_host="localhost")
    service = WorkerService(config, r)
    assert service.hello().kv_transfer_address == ""
    service.start_kv_transfer()
    assert service.kv_transfer is not None
    try:
        hello = service.hello()
        assert hello.kv_transfer_address.startswith("localhost:")
        assert hello.kv_block_bytes == r.kv_tiers.block_bytes
        assert (hello.num_host_blocks, hello.num_disk_blocks) == (0, 0)
        address = service.kv_transfer.address.replace("localhost", "127.0.0.1")
        transport = TcpTransport(timeout_s=5.0)
        got: dict[int, bytes] = {}

        def fetch(instance_id: str) -> int:
            return transport.fetch(
                address,
                instance_id,
                KV_DEVICE,
                [3],
                r.kv_tiers.block_bytes,
                lambda i, data: got.__setitem__(i, bytes(data)),
            )

        old = service.instance_id
        assert fetch(old) == r.kv_tiers.block_bytes and set(got) == {0}
        service.instance_id = "after-a-failed-step"
        with pytest.raises(KVTransferError):
            fetch(old)
        assert fetch("after-a-failed-step") == r.kv_tiers.block_bytes
    finally:
        service.kv_transfer.close()
        r.close()


def test_a_port_in_use_leaves_the_worker_without_a_transfer_server(tiny_models, caplog):
    r = runner(tiny_models["llama"])
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        service = WorkerService(WorkerServiceConfig(worker_id="w-kv", kv_transfer_port=port), r)
        service.start_kv_transfer()
    assert service.kv_transfer is None and service.hello().kv_transfer_address == ""
    assert f"no KV-transfer server on 127.0.0.1:{port}" in caplog.text
    r.close()
