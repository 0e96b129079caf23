"""skiff's compute kernels: Triton kernels for CUDA, each beside a plain-torch reference.

`kernels.ops` is the entry point the model code calls; it picks the Triton kernel for CUDA
tensors and the torch reference (`kernels.reference`) otherwise. One module per kernel:
`activation` (SiLU-and-mul), `rms_norm` (fused residual add + RMSNorm), `rotary` (neox RoPE
from a cos/sin cache), `kv_cache` (paged KV write through slot_mapping), `paged_attention`
(mixed prefill/decode batches against the paged cache), `lora` (batched LoRA adapters:
shrink and expand over each token's adapter slot). `compile_check` compiles them all
for a CUDA architecture without a GPU.
"""
