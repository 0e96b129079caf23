// The sampler's CPU ops, registered as `skiff_cpu::*` (services/worker/sampler/logit_stats.py
// and block_topk.py):
//
// - logit_stats(x, banned, out) -> (block_max, lse): of each row of fp32 logits x [r, vocab]
//   (rows of contiguous tokens, any row stride), in one read of the row from memory, the
//   maximum of each whole block of 64 tokens ([r, vocab / 64], torch's amax of the blocks) and
//   the logsumexp ([r, 1], within a few ulp of torch's); where `out` [r, vocab] (contiguous)
//   is given, x with -inf where `banned` [r, vocab] (bool, contiguous; None: a plain copy) is
//   written into it on the way;
// - row_topk(x, k) -> (values, indices): torch.topk(x, k, dim=1) of fp32 x [r, n] (rows of
//   contiguous values) for a small k: the same values, descending, and among equal values
//   the lower index first (NaN above everything, as torch.topk has it). One pass over each
//   row against its current k-th value; torch's topk costs several times as much per row;
// - row_argmax(x) -> ids: torch.argmax(x, dim=1) of fp32 x [r, n] (the first index of each
//   row's maximum, of its first NaN where it holds one), from the block maxima of one read.
//   torch's argmax is not vectorized, and at a decode step its OpenMP threads, asleep since
//   the last torch op, cost more to wake than the row takes.
//
// Rows are split over the ops' own spinning pool (spin_pool.h), as the model's ops are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "sampler_kernels.h"
#include "spin_pool.h"

namespace skiff_cpu {

const SamplerKernels& sampler_kernels() {
  return std::string_view(isa()) == "avx512" ? sampler_avx512::sampler_kernels
                                             : sampler_avx2::sampler_kernels;
}

}  // namespace skiff_cpu

namespace {

constexpr int64_t kRowsPerTask = 4;        // logit_stats: a row is ~200 KB of work
constexpr int64_t kTopkRowsPerTask = 64;   // row_topk: a row is well under a microsecond

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
  skiff_cpu::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row(x.data_ptr<float>() + r * x.stride(0),
          has_banned ? banned->data_ptr<bool>() + r * vocab : nullptr,
          has_out ? out->data_ptr<float>() + r * vocab : nullptr, vocab,
          block_max.data_ptr<float>() + r * blocks, lse.data_ptr<float>() + r);
  });
  return {block_max, lse};
}

// Whether a ranks above b in row_topk's order (equal values: neither; NaN above numbers).
inline bool ranks_above(float a, float b) { return a > b || (std::isnan(a) && !std::isnan(b)); }

// The k >= 1 largest of x[0, n) into values / indices [k], descending, equal values by index.
void row_topk_of(const float* x, int64_t n, int64_t k, float* values, int64_t* indices) {
  int64_t filled = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (filled == k && !ranks_above(v, values[k - 1])) continue;  // the common case
    int64_t at = filled == k ? k - 1 : filled++;
    for (; at > 0 && ranks_above(v, values[at - 1]); --at) {
      values[at] = values[at - 1];
      indices[at] = indices[at - 1];
    }
    values[at] = v;
    indices[at] = i;
  }
}

std::tuple<at::Tensor, at::Tensor> row_topk(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              "row_topk: x must be fp32 CPU [r, n] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(0 <= k && k <= n, "row_topk: k must be in [0, n]");
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  if (k == 0) return {values, indices};
  skiff_cpu::parallel_for(0, rows, kTopkRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      row_topk_of(x.data_ptr<float>() + r * x.stride(0), n, k, values.data_ptr<float>() + r * k,
                  indices.data_ptr<int64_t>() + r * k);
  });
  return {values, indices};
}

at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.size(1) > 0 && (x.stride(1) == 1 || x.size(1) == 1),
              "row_argmax: x must be fp32 CPU [r, n > 0] with contiguous rows");
  TORCH_CHECK(*skiff_cpu::isa() != '\0', "row_argmax: the CPU has neither AVX2 nor AVX-512");
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor ids = at::empty({rows}, x.options().dtype(at::kLong));
  const auto& argmax = skiff_cpu::sampler_kernels().argmax_row;
  skiff_cpu::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> block_max(vocab / skiff_cpu::kLogitBlock);
    for (int64_t r = begin; r < end; ++r)
      ids.data_ptr<int64_t>()[r] = argmax(x.data_ptr<float>() + r * x.stride(0), vocab,
                                          block_max.data());
  });
  return ids;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(skiff_cpu, m) {
  m.def("logit_stats(Tensor x, Tensor? banned, Tensor(a!)? out) -> (Tensor, Tensor)");
  m.def("row_topk(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("row_argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(skiff_cpu, CPU, m) {
  m.impl("logit_stats", &logit_stats);
  m.impl("row_topk", &row_topk);
  m.impl("row_argmax", &row_argmax);
}
