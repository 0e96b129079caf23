// The sampler's CPU op, registered as `skiff_cpu::logit_stats` (services/worker/sampler/
// logit_stats.py):
//
// - logit_stats(x, banned, out) -> (block_max, lse): of each row of fp32 logits x [r, vocab]
//   (rows of contiguous tokens, any row stride), in one read of the row from memory, the
//   maximum of each whole block of 64 tokens ([r, vocab / 64], torch's amax of the blocks) and
//   the logsumexp ([r, 1], within a few ulp of torch's); where `out` [r, vocab] (contiguous)
//   is given, x with -inf where `banned` [r, vocab] (bool, contiguous; None: a plain copy) is
//   written into it on the way. Rows are split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "cpu_kernels.h"
#include "sampler_kernels.h"

namespace skiff_cpu {

const SamplerKernels& sampler_kernels() {
  return std::string_view(isa()) == "avx512" ? sampler_avx512::sampler_kernels
                                             : sampler_avx2::sampler_kernels;
}

}  // namespace skiff_cpu

namespace {

constexpr int64_t kRowsPerTask = 4;

void check_like(const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == x.sizes() &&
                  t.is_contiguous(),
              "logit_stats: ", name, " must be a contiguous CPU tensor of x's shape");
}

std::tuple<at::Tensor, at::Tensor> logit_stats(const at::Tensor& x,
                                               const std::optional<at::Tensor>& banned,
                                               const std::optional<at::Tensor>& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              "logit_stats: x must be fp32 CPU [r, vocab] with contiguous rows");
  TORCH_CHECK(*skiff_cpu::isa() != '\0', "logit_stats: the CPU has neither AVX2 nor AVX-512");
  const bool has_out = out.has_value() && out->defined();
  const bool has_banned = banned.has_value() && banned->defined();
  TORCH_CHECK(has_out || !has_banned, "logit_stats: banned needs out");
  if (has_out) check_like(*out, x, at::kFloat, "out");
  if (has_banned) check_like(*banned, x, at::kBool, "banned");
  const int64_t rows = x.size(0), vocab = x.size(1), blocks = vocab / skiff_cpu::kLogitBlock;
  at::Tensor block_max = at::empty({rows, blocks}, x.options());
  at::Tensor lse = at::empty({rows, 1}, x.options());
  const auto& row = skiff_cpu::sampler_kernels().logit_row;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row(x.data_ptr<float>() + r * x.stride(0),
          has_banned ? banned->data_ptr<bool>() + r * vocab : nullptr,
          has_out ? out->data_ptr<float>() + r * vocab : nullptr, vocab,
          block_max.data_ptr<float>() + r * blocks, lse.data_ptr<float>() + r);
  });
  return {block_max, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(skiff_cpu, m) {
  m.def("logit_stats(Tensor x, Tensor? banned, Tensor(a!)? out) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(skiff_cpu, CPU, m) { m.impl("logit_stats", &logit_stats); }
