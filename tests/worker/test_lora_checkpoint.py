"""PEFT LoRA checkpoints read and checked against a model (each reason an adapter is refused),
the LRU slot table, and the fused slices' layout in the stacked slot weights."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from kernels import cpu_ops, ops
from kernels.lora_mapping import LoRAMapping
from services.worker.lora.checkpoint import WEIGHTS_FILE, read_adapter
from services.worker.lora.errors import LoRAError
from services.worker.lora.slots import SlotTable
from services.worker.lora.targets import ModuleShape, module_shapes
from services.worker.lora.weights import LoRAStep, ModuleLoRA
from services.worker.model_config import ModelConfig
from shared.wire import LoRARequest

# q 4 heads x 8, k/v 2 heads x 8; 2 layers
MC = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=False,
    qk_norm=False,
    eos_token_id=None,
    extra_eos_token_ids=(),
)
PREFIX = "base_model.model.model.layers"
RANK = 4


def _lora(path, root: Path | str = "") -> LoRARequest:
    return LoRARequest(lora_name="a", lora_path=str(path), root=str(root))


def valid_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "down_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "base_model_name_or_path": "tiny",
    }
    return config | overrides


def valid_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"{PREFIX}.1.self_attn.q_proj.lora_A.weight": torch.randn(RANK, 32, generator=g),
        f"{PREFIX}.1.self_attn.q_proj.lora_B.weight": torch.randn(32, RANK, generator=g),
        f"{PREFIX}.0.mlp.down_proj.lora_A.weight": torch.randn(RANK, 48, generator=g),
        f"{PREFIX}.0.mlp.down_proj.lora_B.weight": torch.randn(32, RANK, generator=g),
    }


def write_adapter(
    path: Path,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(config or valid_config()))
    save_file(valid_tensors() if tensors is None else tensors, path / "adapter_model.safetensors")
    return path


def test_a_valid_adapter_has_its_scaling_folded_into_lora_b(tmp_path):
    adapter = read_adapter(_lora(write_adapter(tmp_path)), MC, max_rank=16, base_model="/m/tiny")
    assert (adapter.rank, adapter.scaling) == (RANK, 2.0)
    assert set(adapter.weights) == {(1, "q_proj"), (0, "down_proj")}
    tensors = valid_tensors()
    a, b = adapter.weights[1, "q_proj"]
    assert torch.equal(a, tensors[f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(b, tensors[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] * 2.0)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path):
    path = write_adapter(tmp_path, valid_config(use_rslora=True, lora_alpha=6))
    assert read_adapter(_lora(path), MC, max_rank=16).scaling == 6 / math.sqrt(RANK)


def test_a_regex_target_is_read_off_the_tensors(tmp_path):
    path = write_adapter(tmp_path, valid_config(target_modules=r".*\.(q_proj|down_proj)"))
    assert len(read_adapter(_lora(path), MC, max_rank=16).weights) == 2
    all_linear = write_adapter(tmp_path / "all", valid_config(target_modules="all-linear"))
    assert len(read_adapter(_lora(all_linear), MC, max_rank=16).weights) == 2


def test_another_base_model_is_only_a_warning(tmp_path, caplog):
    path = write_adapter(tmp_path, valid_config(base_model_name_or_path="org/other-model"))
    with caplog.at_level(logging.WARNING, logger="skiff.worker"):
        read_adapter(_lora(path), MC, max_rank=16, base_model="/models/tiny")
    assert "trained on org/other-model" in caplog.text


def _tensor(name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape)}


A_KEY = f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"
B_KEY = f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"
REFUSED = {
    "rank above max": (valid_config(r=32), None, "rank 32 is above this worker's max_lora_rank"),
    "rank not positive": (valid_config(r=0), None, "r must be a positive integer"),
    "not LoRA": (valid_config(peft_type="IA3"), None, "peft_type 'IA3' is not LORA"),
    "bias": (valid_config(bias="all"), None, "bias 'all' is not supported"),
    "modules_to_save": (
        valid_config(modules_to_save=["lm_head"]),
        None,
        "modules_to_save (fully trained extra modules) is not supported",
    ),
    "fan_in_fan_out": (valid_config(fan_in_fan_out=True), None, "fan_in_fan_out"),
    "dora": (valid_config(use_dora=True), None, "use_dora (DoRA) is not supported"),
    "rank_pattern": (valid_config(rank_pattern={"q_proj": 8}), None, "rank_pattern"),
    "unknown target in config": (
        valid_config(target_modules=["q_proj", "dense"]),
        None,
        "unknown target modules ['dense']",
    ),
    "no targets": (valid_config(target_modules=[]), None, "target_modules must be"),
    "bad regex": (valid_config(target_modules="(q_proj"), None, "is no regex"),
    "unknown target tensor": (
        None,
        _tensor(f"{PREFIX}.0.self_attn.qkv.lora_A.weight", (RANK, 32)),
        "unknown target module self_attn.qkv",
    ),
    "target under the wrong parent": (
        None,
        _tensor(f"{PREFIX}.0.mlp.q_proj.lora_A.weight", (RANK, 32)),
        "unknown target module mlp.q_proj",
    ),
    "tensor not among target_modules": (
        None,
        valid_tensors() | _tensor(f"{PREFIX}.0.self_attn.v_proj.lora_A.weight", (RANK, 32)),
        "v_proj is not among target_modules",
    ),
    "embedding": (
        valid_config(target_modules=r".*"),
        _tensor("base_model.model.model.embed_tokens.lora_embedding_A", (RANK, 64)),
        "embedding and LM head adapters are not supported",
    ),
    "lm_head": (
        valid_config(target_modules=r".*"),
        _tensor("base_model.model.lm_head.lora_A.weight", (RANK, 32)),
        "embedding and LM head adapters are not supported",
    ),
    "other tensor": (None, _tensor("something.else", (1,)), "unsupported tensor something.else"),
    "layer out of range": (
        None,
        _tensor(f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", (RANK, 32)),
        "the model has 2 layers",
    ),
    "lora_B missing": (
        None,
        {A_KEY: torch.zeros(RANK, 32)},
        "layer 1 q_proj: lora_B is missing",
    ),
    "lora_A of the wrong shape": (
        None,
        {A_KEY: torch.zeros(RANK, 31), B_KEY: torch.zeros(32, RANK)},
        "lora_A (4, 31) and lora_B (32, 4) do not fit the model",
    ),
    "lora_B of another rank": (
        None,
        {A_KEY: torch.zeros(RANK, 32), B_KEY: torch.zeros(32, 2)},
        "do not fit the model (expected (4, 32) and (32, 4))",
    ),
    "no weights": (None, {}, "holds no LoRA weights"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_adapter_the_worker_cannot_run_is_refused_with_its_reason(tmp_path, case):
    config, tensors, reason = REFUSED[case]
    path = write_adapter(tmp_path, config, tensors)
    with pytest.raises(LoRAError, match=re.escape(reason)):
        read_adapter(_lora(path), MC, max_rank=16)


def test_missing_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(LoRAError, match=r"no adapter_config\.json in"):
        read_adapter(_lora(tmp_path / "nowhere"), MC, max_rank=16)
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match=r"no adapter_model\.safetensors in"):
        read_adapter(_lora(path), MC, max_rank=16)
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="unreadable"):
        read_adapter(_lora(path), MC, max_rank=16)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(LoRAError, match="unreadable"):
        read_adapter(_lora(path), MC, max_rank=16)


def test_slots_go_to_free_ones_then_to_the_least_recently_used():
    table = SlotTable(2)
    assert table.claim("a", {"a"}) == 0 and table.claim("b", {"b"}) == 1
    table.use("a")  # b is now the least recently used
    assert table.claim("c", {"c"}) == 1 and table.names() == ["a", "c"]
    assert table.claim("d", {"d", "c"}) == 0 and table.names() == ["c", "d"]
    table.release("c")
    assert table.claim("e", {"e", "d"}) == 1 and table.names() == ["d", "e"]


def test_no_slot_is_taken_from_an_adapter_of_the_current_step():
    table = SlotTable(2)
    table.claim("a", {"a", "b"})
    table.claim("b", {"a", "b"})
    with pytest.raises(LoRAError, match="more adapters than this worker's max_loras 2"):
        table.claim("c", {"a", "b", "c"})
    assert table.names() == ["a", "b"]


@torch.inference_mode()
def test_fused_slices_add_each_slice_update_to_its_own_outputs():
    """qkv_proj's slices in the stacked slot weights: a rank-2 adapter on q and v (none on k)
    in slot 1 of rank-4 slots adds B_q A_q x to q's outputs and B_v A_v x to v's, nothing to
    k's; slot 0 stays zero."""
    shape = module_shapes(MC)["self_attn.qkv_proj"]  # 32 -> 32 | 16 | 16
    lora = ModuleLoRA(LoRAStep(), shape, 2, 4, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    a_q, b_q = torch.randn(2, 32, generator=g), torch.randn(32, 2, generator=g)
    a_v, b_v = torch.randn(2, 32, generator=g), torch.randn(16, 2, generator=g)
    lora.write(1, 0, a_q, b_q)
    lora.write(1, 2, a_v, b_v)
    x = torch.randn(3, 32, generator=g)
    y = torch.zeros(3, 64)
    slots = torch.tensor([1, -1, 1])
    ops.add_lora(y, x, lora.lora_a, lora.lora_b, LoRAMapping.build(slots), lora.slice_sizes)
    want = torch.zeros(3, 64)
    want[:, :32] = x @ a_q.t() @ b_q.t()
    want[:, 48:] = x @ a_v.t() @ b_v.t()
    want[1] = 0
    torch.testing.assert_close(y, want)
    # on the CPU, lora_b holds each slice's [outputs, R] in panels of 16, slice after slice
    assert lora.panels and lora.lora_b.shape == (2, 2 + 1 + 1, 4, 16)
    q_b, v_b = (
        cpu_ops.unpack_panels(lora.lora_b[1, :2], 32),
        cpu_ops.unpack_panels(lora.lora_b[1, 3:], 16),
    )
    assert torch.equal(q_b[:, :2], b_q) and torch.equal(v_b[:, :2], b_v)
    assert not q_b[:, 2:].any() and not v_b[:, 2:].any() and not lora.lora_b[1, 2].any()
    assert not lora.lora_a[0].any() and not lora.lora_b[0].any()


def test_a_runtime_load_may_not_leave_the_adapter_root_through_a_symlink(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    write_adapter(outside)
    (root / "escape").symlink_to(outside)  # the directory itself
    inside = write_adapter(root / "inside")
    (inside / WEIGHTS_FILE).unlink()
    (inside / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)  # one of its files
    for path in (root / "escape", inside):
        with pytest.raises(LoRAError, match="leads outside the adapter root"):
            read_adapter(_lora(path, root), MC, max_rank=16)
        read_adapter(_lora(path), MC, max_rank=16)  # --lora-modules: the operator's choice
    write_adapter(root / "fine")
    (root / "link").symlink_to(root / "fine")  # a symlink that stays inside is fine
    assert read_adapter(_lora(root / "link", root), MC, max_rank=16).rank == RANK


@torch.inference_mode()
@pytest.mark.parametrize(
    ("sizes", "rank", "max_rank"), [((40, 24, 24), 3, 8), ((200,), 16, 16), ((96, 96), 8, 16)]
)
def test_slot_panels_give_each_slice_its_own_update(sizes, rank, max_rank):
    """Slices of uneven and partial-panel widths, one slice alone, ranks below and at the
    slots': the CPU op's update of each slice is B_i A_i x, whatever the other slices hold."""
    shape = ModuleShape(64, sizes)
    lora = ModuleLoRA(LoRAStep(), shape, 3, max_rank, torch.device("cpu"), torch.float32)
    assert lora.panels
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 64, generator=g)
    slots = torch.tensor([2, -1, 0, 2, 2])
    want = torch.zeros(5, sum(sizes), dtype=torch.float64)
    for slot in (0, 2):
        for i, size in enumerate(sizes):
            a, b = torch.randn(rank, 64, generator=g), torch.randn(size, rank, generator=g)
            lora.write(slot, i, a, b)
            out0 = sum(sizes[:i])
            rows = slots == slot
            want[rows, out0 : out0 + size] = (x[rows].double() @ a.double().t()) @ b.double().t()
    y = torch.zeros(5, sum(sizes))
    ops.add_lora(y, x, lora.lora_a, lora.lora_b, LoRAMapping.build(slots), lora.slice_sizes)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
