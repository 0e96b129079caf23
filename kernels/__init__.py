"""skiff's compute kernels: Triton kernels for CUDA, each beside a plain-torch reference.

`kernels.ops` is the entry point the model code calls; it picks the Triton kernel for CUDA
tensors and the torch reference otherwise.
"""
