"""Lower-precision storage for the CPU worker's projection weights (`--cpu-weights`), off by
default: the fp32 weights are exact (greedy output equals transformers'), the others trade
agreement for speed, because a CPU decode step is bound by reading the weights.

- `fp32`: as loaded.
- `bf16`: each weight rounded to bfloat16 (half the bytes); products and sums stay fp32.
- `bf16_dot`: the same weights, and the activations rounded to bfloat16 too, as llama.cpp's
  BF16 dot product does (W16A16): pairs of bf16 products summed into fp32 (AVX512-BF16
  `vdpbf16ps` where the CPU has it, else the pairs widened to fp32; the same bits). x is
  rounded per element, so a token's bits do not depend on its batch. The LM head keeps fp32
  x (`bf16`'s arithmetic), as `q8_0`'s does: on SmolLM2-135M that raises greedy agreement
  with fp32 from 82.6% / 81.0% to 85.4% / 88.2% (workload / chat) for ~7% of the decode
  speed (docs/benchmarks.md).
- `int8`: symmetric int8 with an fp32 scale per group of 32 weights of a row (like
  llama.cpp's Q8_0), weight = q * scale (9/32 of the bytes); x stays fp32 (W8A32).
- `q8_0`: the same weights, and the activations quantized too, as llama.cpp's Q8_0 x Q8_0
  dot product does (W8A8): each row of x to int8 per group of 32 (scale max |x| / 127), int32
  dot products per group (VNNI `vpdpbusd`, or AVX2), summed in fp32 times both scales. A
  token's bits still do not depend on its batch (x is quantized per row). The LM head, the
  matrix greedy choices are most sensitive to, keeps fp32 x (`int8`'s arithmetic, W8A32):
  the bytes of llama.cpp's Q8_0 output matrix, without rounding the last hidden state. On
  SmolLM2-135M greedy agreement with fp32 is 58% / 50% (workload / chat) against 44% / 47%
  with x quantized and 55% / 50% with a bf16 head, which reads twice the bytes (its LM head
  took a fifth of a single-stream decode step; docs/benchmarks.md, bench/precision.py).

Every projection and the LM head are converted (a tied LM head gets its own copy, the
embedding lookup stays fp32); norms, activations and the KV cache stay fp32. The C++ ops
(`kernels/cpu_ops.py`) read all of them. Projections whose weight runs faster so also
are packed in panels for the panel kernel instead (`pack_panels`), in the same format; `q8_0`
and `bf16_dot` weights always are (`cpu_ops.pack_q8_panels`, `cpu_ops.pack_bf16_panels`: their
kernels read only panels).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu_ops
from services.worker.config import CPU_WEIGHT_FORMATS
from services.worker.models.decoder import DecoderForCausalLM

INT8_GROUP = 32  # weights per scale; kInt8Group in kernels/csrc/cpu_kernels.h


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] fp32 -> (int8 [N, K], fp32 scale [N, K / 32]): weight ~= q * scale per group."""
    if weight.shape[-1] % INT8_GROUP:
        raise ValueError(f"int8 weights need in_features % {INT8_GROUP} == 0, got {weight.shape}")
    groups = weight.reshape(weight.shape[0], -1, INT8_GROUP)  # [N, K / 32, 32]
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-12) / 127
    q = torch.round(groups / scale).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), scale.squeeze(2).float()


def convert_weights(model: DecoderForCausalLM, weight_format: str) -> None:
    """Store every projection of `model` (on the CPU, fp32) in `weight_format`, in place."""
    if weight_format not in CPU_WEIGHT_FORMATS:
        raise ValueError(f"cpu weights must be one of {', '.join(CPU_WEIGHT_FORMATS)}")
    if weight_format == "fp32":
        return
    if model.lm_head is None:  # tied: the LM head gets its own copy of the embedding
        vocab, hidden = model.embed_tokens.weight.shape
        model.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach(), requires_grad=False)
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight.detach()
        if weight_format in ("bf16", "bf16_dot"):
            module.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        else:
            q, scale = quantize_int8(weight)
            module.weight = nn.Parameter(q, requires_grad=False)
            module.register_buffer("weight_scale", scale)


def pack_panels(model: nn.Module, weight_format: str = "fp32") -> list[str]:
    """Give each projection of `model` (fp32, bf16 or int8) whose weight runs faster with the
    panel kernel (`cpu_ops.linear_choice`) a `weight_panels` buffer [ceil(out / 16), in, 16]
    (int8: and `weight_panel_scale` [ceil(out / 16), in / 32, 16]); both the linear op and the
    fused decode then use them, so a projection computes the same bits on every path. With
    `weight_format` q8_0, every projection but the LM head (`model.lm_head`, fp32 x) gets Q8_0
    panels [ceil(out / 16), in / 4, 16, 4] instead, and with bf16_dot bf16 pair panels
    [ceil(out / 16), in / 2, 16, 2]. Returns the names of the packed modules. A packed
    module's row-major weight (and int8 scales) become placeholders on the meta device, shape
    and dtype kept: each weight runs one kernel for every M, so nothing reads them, and the
    weights take 1x their bytes, not 2x (torch's fallback, `cpu_ops.use(False)`, unpacks
    fp32 / bf16 panels: `ops.linear`)."""
    packed, head = [], getattr(model, "lm_head", None)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        weight, scale = module.weight, getattr(module, "weight_scale", None)
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.int8):
            continue
        n, k = weight.shape
        panel_scale: torch.Tensor | None
        if weight_format == "q8_0" and scale is not None and module is not head:
            panels, panel_scale = cpu_ops.pack_q8_panels(weight), cpu_ops.pack_panels(scale)
        elif weight_format == "bf16_dot" and module is not head:
            panels, panel_scale = cpu_ops.pack_bf16_panels(weight), None
        elif cpu_ops.linear_choice(n, k, weight.dtype) == "panels":
            panels = cpu_ops.pack_panels(weight)
            panel_scale = None if scale is None else cpu_ops.pack_panels(scale)
        else:
            continue
        module.register_buffer("weight_panels", panels, persistent=False)
        if panel_scale is not None:
            module.register_buffer("weight_panel_scale", panel_scale, persistent=False)
        module.weight = nn.Parameter(weight.detach().to("meta"), requires_grad=False)
        if scale is not None:
            module.weight_scale = scale.to("meta")
        packed.append(name)
    return packed


def unpack_weights(model: nn.Module) -> None:
    """Undo `pack_panels` on fp32 / bf16 weights: each packed projection gets its row-major
    weight back and loses its panels (bench/cpu_step.py's torch engine lays them out for torch)."""
    for module in model.modules():
        panels = getattr(module, "weight_panels", None)
        if not isinstance(module, nn.Linear) or panels is None:
            continue
        if panels.dim() != 3 or getattr(module, "weight_panel_scale", None) is not None:
            raise ValueError("only fp32 / bf16 panels unpack to the weights they were packed from")
        weight = cpu_ops.unpack_panels(panels, module.weight.shape[0]).contiguous()
        module.weight = nn.Parameter(weight, requires_grad=False)
        del module.weight_panels
