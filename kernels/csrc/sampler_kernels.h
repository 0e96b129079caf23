// Raw-pointer row kernels of the sampler's op (sampler_ops.cpp): one body (sampler_bodies.h)
// built for AVX-512F (sampler_avx512.cpp) and for AVX2 with FMA (sampler_avx2.cpp), picked
// by isa() (cpu_kernels.h) like the model's kernels.
#pragma once

#include <cstdint>

namespace skiff_cpu {

// Tokens per block of the block maxima: _BLOCK in services/worker/sampler/block_topk.py.
constexpr int64_t kLogitBlock = 64;

// One row of logits x [vocab], read once from memory: the maximum of each whole block of
// kLogitBlock tokens into block_max [vocab / kLogitBlock] (NaN where the block holds one, as
// torch's amax), and log(sum(e^x)) into *lse (shifted by the row's maximum, or by 0 where that
// is +-inf, as torch's logsumexp; e^x from a degree-7 polynomial after a two-constant ln 2
// reduction, the sum in fp64 over fp32 partial sums). Where `out` is given, x with -inf where
// banned[t] (banned may be null: a plain copy) goes into out [vocab] on the way.
using LogitRow = void (*)(const float* x, const bool* banned, float* out, int64_t vocab,
                          float* block_max, float* lse);

// The first index of the maximum of x [vocab] (of its first NaN where it holds one), as
// torch.argmax; block_max [vocab / kLogitBlock] is scratch.
using ArgmaxRow = int64_t (*)(const float* x, int64_t vocab, float* block_max);

struct SamplerKernels {
  LogitRow logit_row;
  ArgmaxRow argmax_row;
};

namespace sampler_avx512 {
extern const SamplerKernels sampler_kernels;
}
namespace sampler_avx2 {
extern const SamplerKernels sampler_kernels;
}

// The kernels of isa(); isa() must not be "".
const SamplerKernels& sampler_kernels();

}  // namespace skiff_cpu
