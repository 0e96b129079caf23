// The CPU worker's fp32 ops, registered as `skiff_cpu::*` (see kernels/cpu_ops.py):
//
// - linear(x, weight, bias, weight_scale): x @ weight^T + bias, streaming the weight (a
//   decode step multiplies a few token rows by every matrix, so the step is bound by reading
//   weights); the weight is fp32, bf16, or int8 with fp32 scales per group of 32 weights;
// - linear_packed(x, packed, out_features, bias, scale): the same with the weight (any of the
//   three formats) packed in panels of 16 output features ([ceil(N / 16), K, 16], the int8
//   scales likewise; kernels/cpu_ops.py pack_panels): a register tile of token rows x
//   panels takes each weight once per tile and no horizontal sums, which makes prefill
//   chunks (M = 8..512) run near the FMA peak. Int8 panels packed for 4-byte dot products
//   ([ceil(N / 16), K / 4, 16, 4], pack_q8_panels) run Q8_0 x Q8_0 instead: x quantized to
//   int8 per row and group of 32, int32 dot products (VNNI or AVX2), fp32 group sums; bf16
//   panels packed in pairs ([ceil(N / 16), K / 2, 16, 2], pack_bf16_panels) run bf16 x bf16:
//   x rounded to bf16, pairs of products summed into fp32 (AVX512-BF16, or widened). Each
//   kernel computes each
//   output with one fixed order of its sum over k for every M, every place of the row in the
//   batch and every tile, so a token's bits do not depend on its batch; a weight runs one
//   kernel for all M (cpu_ops.py linear_choice), in this op and in decode_layers alike;
// - decode_layers(...): every decoder layer of a decode-only step (one query token per
//   request) in a single call, each layer: residual add + RMSNorm, QKV projection (+ bias, q/k
//   norm), rotary, KV-cache write, paged attention read straight from the cache through the
//   block table, output projection, residual add + RMSNorm, gate/up projection, SiLU-and-mul,
//   down projection; with LoRA adapters, each projection adds its tokens' adapter updates;
// - add_lora(y, x, lora_a, lora_b_panels, slots, slice_sizes): y += each token's adapter
//   update lora_b[s] @ (lora_a[s] @ x[t]), s = slots[t] (-1: none), per fused slice (q, k, v;
//   gate, up), lora_b in panels of 16 outputs of a slice; the tokens of one adapter multiplied
//   together with the linear kernels (a token's bits do not depend on the others);
// - paged_attention(...): causal attention of a step's tokens (decode and prefill chunks)
//   against the paged cache, read in place through the block table: a decode token reads its
//   context once for its query heads, a prefill chunk once per tile of its tokens;
// - rms_norm, rotary_embedding, silu_and_mul: the model's elementwise ops, as
//   kernels/reference.py defines them, for the steps that run the model module by module.
//
// All of them split work over torch's thread count, on the spinning pool of spin_pool.h.
// linear falls back to at::linear where its kernel does not apply; the others check their
// inputs and refuse what they do not cover.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <numeric>
#include <string>
#include <vector>

#include "cpu_kernels.h"
#include "spin_pool.h"

namespace {

using skiff_cpu::kInt8Group;
using skiff_cpu::kLinearRowBlock;
using skiff_cpu::kPanel;
using skiff_cpu::kQ8Quad;
using skiff_cpu::WeightFormat;

constexpr int64_t kTokensPerChunk = 64;  // rows of x kept in cache while the weight streams
constexpr int64_t kLoRAPanels = 4;       // output panels of one LoRA expand work item
constexpr int64_t kLoRARows = 16;        // tokens of one LoRA shrink work item (of a slice)

bool is_fp32_cpu(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat;
}

// A weight matrix [N, K] as the kernels read it.
struct Weight {
  const void* data;
  WeightFormat format;
  const float* scale;  // int8 only
  bool panels;         // packed in panels (pack_panels in kernels/cpu_ops.py)
  bool q8;             // int8 panels for Q8_0 x Q8_0 (pack_q8_panels): x is quantized too
  bool bf16_pairs;     // bf16 panels for bf16 x bf16 (pack_bf16_panels): x is rounded too
};

// K of a weight: [N, K], panels [P, K, kPanel], Q8_0 panels [P, K / kQ8Quad, kPanel, kQ8Quad]
// or bf16 pair panels [P, K / kBf16Pair, kPanel, kBf16Pair].
int64_t in_features(const at::Tensor& w) {
  return w.dim() == 4 ? w.size(1) * w.size(3) : w.size(1);
}

// bf16 pair panels [ceil(N / kPanel), K / kBf16Pair, kPanel, kBf16Pair] (no scale), or nullopt.
std::optional<Weight> as_bf16_pairs(const at::Tensor& w, const std::optional<at::Tensor>& scale,
                                    int64_t N) {
  const bool ok = w.device().is_cpu() && w.is_contiguous() &&
                  w.scalar_type() == at::kBFloat16 && w.size(0) == (N + kPanel - 1) / kPanel &&
                  w.size(2) == kPanel && w.size(3) == skiff_cpu::kBf16Pair &&
                  !(scale.has_value() && scale->defined());
  if (!ok) return std::nullopt;
  return Weight{w.data_ptr(), WeightFormat::kBFloat16, nullptr, true, false, true};
}

// `w` for N outputs as the kernels read it: row-major [N, K] (`linear_rows`, K % 16 == 0) or
// panels [ceil(N / kPanel), K, kPanel] (`linear_panels`), fp32, bf16, or int8 with its group
// scales ([N, K / kInt8Group], panels: [ceil(N / kPanel), K / kInt8Group, kPanel]), or
// Q8_0 panels [ceil(N / kPanel), K / kQ8Quad, kPanel, kQ8Quad] with the panels' scales
// (`linear_q8_panels`, K % kInt8Group == 0), or bf16 pair panels (`linear_bf16_panels`);
// nullopt where they cannot.
std::optional<Weight> as_weight(const at::Tensor& w, const std::optional<at::Tensor>& scale,
                                int64_t N) {
  if (w.dim() == 4 && w.scalar_type() == at::kBFloat16) return as_bf16_pairs(w, scale, N);
  if (w.dim() == 4) {  // Q8_0 panels + scales [P, K / kInt8Group, kPanel]
    const int64_t P = (N + kPanel - 1) / kPanel, K = in_features(w);
    const bool ok = w.device().is_cpu() && w.is_contiguous() && w.scalar_type() == at::kChar &&
                    w.size(0) == P && w.size(2) == kPanel && w.size(3) == kQ8Quad &&
                    K % kInt8Group == 0 && scale.has_value() && scale->defined() &&
                    is_fp32_cpu(*scale) && scale->is_contiguous() &&
                    scale->sizes().equals({P, K / kInt8Group, kPanel});
    if (!ok) return std::nullopt;
    return Weight{w.data_ptr(), WeightFormat::kInt8, scale->data_ptr<float>(), true, true, false};
  }
  const bool panels = w.dim() == 3;
  if (!w.device().is_cpu() || !w.is_contiguous() ||
      (panels ? w.size(2) != kPanel || w.size(0) != (N + kPanel - 1) / kPanel
              : w.dim() != 2 || w.size(0) != N || w.size(1) % 16 != 0))
    return std::nullopt;
  const int64_t K = w.size(1);
  const bool has_scale = scale.has_value() && scale->defined();
  switch (w.scalar_type()) {
    case at::kFloat:
      if (!has_scale) return Weight{w.data_ptr(), WeightFormat::kFloat32, nullptr, panels, false, false};
      break;
    case at::kBFloat16:
      if (!has_scale) return Weight{w.data_ptr(), WeightFormat::kBFloat16, nullptr, panels, false, false};
      break;
    case at::kChar: {
      if (!has_scale || !is_fp32_cpu(*scale) || !scale->is_contiguous() ||
          K % skiff_cpu::kInt8Group != 0)
        break;
      const int64_t groups = K / skiff_cpu::kInt8Group;
      const auto want = panels ? std::vector<int64_t>{w.size(0), groups, kPanel}
                               : std::vector<int64_t>{N, groups};
      if (scale->sizes().equals(want))
        return Weight{w.data_ptr(), WeightFormat::kInt8, scale->data_ptr<float>(), panels, false,
                      false};
      break;
    }
    default:
      break;
  }
  return std::nullopt;
}

// The weight in fp32 (int8 times its group scales), for what the kernels do not cover.
at::Tensor dequantized(const at::Tensor& w, const std::optional<at::Tensor>& scale) {
  at::Tensor out = w.to(at::kFloat);
  if (!scale.has_value() || !scale->defined()) return out;
  const at::Tensor groups = out.view({w.size(0), -1, skiff_cpu::kInt8Group});
  return (groups * scale->unsqueeze(2)).view_as(w);
}

// y [M, N] = x [M, K] @ w [N, K]^T with x rounded to bf16 first (w: bf16 pair panels).
void linear_bf16_into(const float* x, const Weight& w, float* y, int64_t M, int64_t K,
                      int64_t N) {
  const skiff_cpu::Bf16Kernels& bf16 = skiff_cpu::bf16_kernels();
  std::vector<uint16_t> xb(M * K);
  skiff_cpu::parallel_for(0, M * K, 8192, [&](int64_t begin, int64_t end) {
    bf16.round(x + begin, xb.data() + begin, end - begin);
  });
  const auto* packed = static_cast<const uint16_t*>(w.data);
  skiff_cpu::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    bf16.linear_panels(xb.data(), packed, y, M, K, N, begin, end);
  });
}

// y [M, N] = x [M, K] @ w [N, K]^T; x and y contiguous fp32. Panels: the threads split
// the panels, each runs all M rows (Q8_0: x quantized first; bf16 pairs: x rounded first);
// rows: chunks of M, the threads split the weight rows.
void linear_into(const float* x, const Weight& w, float* y, int64_t M, int64_t K, int64_t N) {
  if (w.bf16_pairs) {
    linear_bf16_into(x, w, y, M, K, N);
    return;
  }
  if (w.q8) {
    const skiff_cpu::Q8Kernels& q8 = skiff_cpu::q8_kernels();
    const int64_t groups = M * K / kInt8Group;
    std::vector<int8_t> xq(M * K);
    std::vector<float> x_scale(groups);
    skiff_cpu::parallel_for(0, groups, 256, [&](int64_t begin, int64_t end) {
      q8.quantize(x + begin * kInt8Group, xq.data() + begin * kInt8Group, x_scale.data() + begin,
                  end - begin);
    });
    const auto* packed = static_cast<const int8_t*>(w.data);
    skiff_cpu::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
      q8.linear_panels(xq.data(), x_scale.data(), packed, w.scale, y, M, K, N, begin, end);
    });
    return;
  }
  if (w.panels) {
    skiff_cpu::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
      skiff_cpu::kernels().linear_panels(x, w.data, w.format, w.scale, y, M, K, N, begin, end);
    });
    return;
  }
  const int64_t blocks = N / kLinearRowBlock;
  for (int64_t m = 0; m < M; m += kTokensPerChunk) {
    const int64_t rows = std::min(kTokensPerChunk, M - m);
    skiff_cpu::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
      skiff_cpu::kernels().linear_rows(x + m * K, w.data, w.format, w.scale, y + m * N, rows, K, N,
                             begin * kLinearRowBlock, end * kLinearRowBlock);
    });
    if (blocks * kLinearRowBlock < N)
      skiff_cpu::kernels().linear_rows(x + m * K, w.data, w.format, w.scale, y + m * N, rows, K, N,
                             blocks * kLinearRowBlock, N);
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& weight_scale) {
  const auto w = as_weight(weight, weight_scale, weight.size(0));
  if (!*skiff_cpu::isa() || !w || !is_fp32_cpu(x) || x.dim() < 1 ||
      x.size(-1) != weight.size(1) || x.numel() == 0) {
    if (weight.scalar_type() == x.scalar_type() && !(weight_scale && weight_scale->defined()))
      return at::linear(x, weight, bias);
    return at::linear(x, dequantized(weight, weight_scale).to(x.scalar_type()), bias);
  }
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();  // [M, K]
  at::Tensor y = at::empty({x2.size(0), N}, x.options());  // [M, N]
  linear_into(x2.data_ptr<float>(), *w, y.data_ptr<float>(), x2.size(0), K, N);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  return y.view(out_shape);
}

// linear with weights packed in panels ([ceil(N / kPanel), K, kPanel], + int8 scales
// [ceil(N / kPanel), K / kInt8Group, kPanel]) for N outputs.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& scale) {
  TORCH_CHECK(*skiff_cpu::isa(), "linear_packed needs AVX2 or AVX-512");
  const auto w = as_weight(packed, scale, out_features);
  TORCH_CHECK(w.has_value() && w->panels && is_fp32_cpu(x) && x.dim() >= 1 &&
                  x.size(-1) == in_features(packed),
              "linear_packed: fp32 x [..., K] and panels [ceil(N / 16), K, 16] (fp32, bf16, "
              "or int8 + scales [ceil(N / 16), K / 32, 16]), or Q8_0 panels "
              "[ceil(N / 16), K / 4, 16, 4] int8 + scales [ceil(N / 16), K / 32, 16] with "
              "K % 32 == 0, or bf16 pair panels [ceil(N / 16), K / 2, 16, 2]");
  const int64_t K = in_features(packed), N = out_features;
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();  // [M, K]
  at::Tensor y = at::empty({x2.size(0), N}, x.options());  // [M, N]
  if (x2.size(0) > 0) linear_into(x2.data_ptr<float>(), *w, y.data_ptr<float>(), x2.size(0), K, N);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  auto out_shape = x.sizes().vec();
  out_shape.back() = N;
  return y.view(out_shape);
}

// [B, N] = x [B, K] @ weight^T (weight [N, K], or its panels), with the checks of decode_layer.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& scale, int64_t N) {
  const auto w = as_weight(weight, scale, N);
  TORCH_CHECK(w.has_value(), "decode_layers: weights are contiguous fp32, bf16 or int8 + scale, "
              "with input dims in multiples of 16, or their panels");
  TORCH_CHECK(in_features(weight) == x.size(1), "decode_layers: a weight does not match its input");
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  linear_into(x.data_ptr<float>(), *w, y.data_ptr<float>(), x.size(0), x.size(1), N);
  return y;
}

// One fused slice of a projection's adapters: outputs [out0, out0 + width) of y, rows
// [index R, (index + 1) R) of lora_a, panels [panel0, panel0 + ceil(width / 16)) of lora_b.
struct LoRASlice {
  int64_t index, out0, width, panel0;
};

// One LoRA expand work item: a slice's panels [p0, p1) (counted from the slice's first).
struct LoRAChunk {
  LoRASlice slice;
  int64_t p0, p1;
};

// The expand's chunks of up to kLoRAPanels panels of each slice of `slice_sizes`, checked
// against y's N outputs and lora_b's P panels.
std::vector<LoRAChunk> lora_chunks(at::IntArrayRef slice_sizes, int64_t N, int64_t P) {
  std::vector<LoRAChunk> chunks;
  int64_t out0 = 0, panel0 = 0;
  for (size_t i = 0; i < slice_sizes.size(); ++i) {
    const int64_t width = slice_sizes[i], panels = (width + kPanel - 1) / kPanel;
    TORCH_CHECK(width > 0, "add_lora: slice sizes are positive");
    const LoRASlice slice{static_cast<int64_t>(i), out0, width, panel0};
    for (int64_t p = 0; p < panels; p += kLoRAPanels)
      chunks.push_back({slice, p, std::min(panels, p + kLoRAPanels)});
    out0 += width;
    panel0 += panels;
  }
  TORCH_CHECK(out0 == N && panel0 == P,
              "add_lora: the slice sizes add up to y's outputs and lora_b holds "
              "sum(ceil(slice / 16)) panels");
  return chunks;
}

// y [T, N] += B_i[s] [N_i, R] @ (A_i[s] [R, K] @ x[t]) on slice i's outputs, for each slice i
// of `slice_sizes` (N_i, adding up to N) and each token t of an adapter slot s = slots[t]
// (-1: none). lora_a [S, n R, K] holds A_i in rows [i R, (i + 1) R); lora_b
// [S, sum_i ceil(N_i / 16), R, 16] each B_i in panels (pack_panels), slice after slice: a fused
// projection's expand reads no zero blocks. Each slot's tokens are gathered; the shrink runs
// linear_rows (K a multiple of 16) per slice and piece of 16 tokens, the expand the panel kernel
// (broadcast x, no horizontal sums over the short R) on chunks of a slice's panels, each
// spread over the threads. Each output is one token's chains alone: its bits do not depend on
// the other tokens.
void add_lora_into(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a,
                   const at::Tensor& lora_b, const at::Tensor& slots,
                   at::IntArrayRef slice_sizes) {
  const at::Tensor& out = y;
  for (const at::Tensor* t : {&out, &x, &lora_a, &lora_b})
    TORCH_CHECK(is_fp32_cpu(*t) && t->is_contiguous(), "add_lora: contiguous fp32 CPU tensors");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.is_contiguous() &&
                  slots.size(0) == x.size(0),
              "add_lora: slots are int32, one per token");
  const int64_t n = static_cast<int64_t>(slice_sizes.size());
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && y.size(0) == x.size(0) && lora_a.dim() == 3 &&
                  lora_b.dim() == 4 && lora_b.size(0) == lora_a.size(0) &&
                  lora_a.size(1) == n * lora_b.size(2) && lora_a.size(2) == x.size(1) &&
                  lora_b.size(3) == kPanel,
              "add_lora: y [T, N], x [T, K], lora_a [S, n R, K], lora_b panels [S, P, R, 16] "
              "for n slices");
  const int64_t num_slots = lora_a.size(0), K = x.size(1), R = lora_b.size(2), N = y.size(1);
  TORCH_CHECK(K % 16 == 0, "add_lora: the input size must be a multiple of 16");
  const auto chunks = lora_chunks(slice_sizes, N, lora_b.size(1));
  // Each slot's tokens in token order: order[start[s] .. start[s + 1]).
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < x.size(0); ++t) {
    TORCH_CHECK(slot_of[t] < num_slots, "add_lora: a slot index is out of range");
    if (slot_of[t] >= 0) ++start[slot_of[t] + 1];
  }
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int64_t> order(start[num_slots]), next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < x.size(0); ++t)
    if (slot_of[t] >= 0) order[next[slot_of[t]]++] = t;
  std::vector<int64_t> used;  // the slots with tokens
  std::vector<std::array<int64_t, 3>> pieces;  // the shrink's work: (slot, first row, slice)
  int64_t max_rows = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t m = start[s + 1] - start[s];
    if (m == 0) continue;
    used.push_back(s);
    max_rows = std::max(max_rows, m);
    for (int64_t i = 0; i < m; i += kLoRARows)
      for (int64_t j = 0; j < n; ++j) pieces.push_back({s, i, j});
  }
  const auto& k = skiff_cpu::kernels();
  const float *xs = x.data_ptr<float>(), *as = lora_a.data_ptr<float>();
  // The shrink's results: slot s's m tokens at start[s] n R, as [n, m, R].
  std::vector<float> shrunk(order.size() * n * R);
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  skiff_cpu::parallel_for(0, num_pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> gathered(kLoRARows * K);
    for (int64_t p = begin; p < end; ++p) {
      const auto [s, i0, j] = pieces[p];
      const int64_t m = start[s + 1] - start[s], rows = std::min(kLoRARows, m - i0);
      for (int64_t i = 0; i < rows; ++i)
        std::copy_n(xs + order[start[s] + i0 + i] * K, K, gathered.data() + i * K);
      k.linear_rows(gathered.data(), as + (s * n + j) * R * K, WeightFormat::kFloat32, nullptr,
                    shrunk.data() + (start[s] * n + j * m + i0) * R, rows, K, R, 0, R);
    }
  });
  const int64_t C = static_cast<int64_t>(chunks.size()), P = lora_b.size(1);
  const float* bs = lora_b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(used.size()) * C;
  skiff_cpu::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> update(max_rows * kLoRAPanels * kPanel);  // [m, cols]
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = used[w / C];
      const auto& [slice, p0, p1] = chunks[w % C];
      const int64_t m = start[s + 1] - start[s];
      const int64_t n0 = p0 * kPanel, cols = std::min(slice.width, p1 * kPanel) - n0;
      k.linear_panels(shrunk.data() + (start[s] * n + slice.index * m) * R,
                      bs + ((s * P + slice.panel0 + p0) * R) * kPanel, WeightFormat::kFloat32,
                      nullptr, update.data(), m, R, cols, 0, p1 - p0);
      for (int64_t j = 0; j < m; ++j) {
        float* row = ys + order[start[s] + j] * N + slice.out0 + n0;
        for (int64_t c = 0; c < cols; ++c) row[c] += update[j * cols + c];
      }
    }
  });
}

// The LoRA adapters of decode_layer's projections: per projection its (lora_a, lora_b), in the
// order qkv, o, gate_up, down (8 tensors), its slices' outputs (q, k, v; o; gate, up; down),
// and each token's slot; none when `lora` is empty.
struct LayerLoRA {
  at::TensorList lora;
  const std::optional<at::Tensor>& slots;
  std::array<std::vector<int64_t>, 4> slice_sizes;

  void add(int projection, at::Tensor& y, const at::Tensor& x) const {
    if (lora.empty()) return;
    add_lora_into(y, x, lora[2 * projection], lora[2 * projection + 1], *slots,
                  slice_sizes[projection]);
  }
};

// One unit of attention work for one KV head: `tokens` consecutive query rows of a request
// (from row `row`), at positions first_pos .. first_pos + tokens - 1 of its context. A decode
// token is a task alone; a prefill chunk is cut into tasks of up to kPrefillRows / group tokens,
// all run by attend_prefill (a chunk's last token alone in its task too), so a prefill row's
// bits do not depend on how its chunk was cut.
struct AttentionTask {
  int64_t row, tokens, request, first_pos, kv_head;
  bool decode;   // a decode token (its request's only query row in the step): `attend`
  int64_t cost;  // query rows x keys read: larger tasks start first
};

// The tasks of a step whose request r has query rows [starts[r], starts[r + 1]) at the end of
// its lens[r]-token context.
std::vector<AttentionTask> attention_tasks(const int32_t* starts, const int32_t* lens,
                                           int64_t num_reqs, int64_t group,
                                           int64_t num_kv_heads) {
  TORCH_CHECK(group <= skiff_cpu::kPrefillRows, "attention: more than 64 query heads per KV head");
  const int64_t tile = skiff_cpu::kPrefillRows / group;  // prefill tokens per task
  std::vector<AttentionTask> tasks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r], first_pos = lens[r] - q_len;
    const int64_t step = q_len == 1 ? 1 : tile;
    for (int64_t j = 0; j < q_len; j += step) {
      const int64_t tokens = std::min(step, q_len - j), keys = first_pos + j + tokens;
      const int64_t rows = q_len == 1 ? group : skiff_cpu::kPrefillRows;
      for (int64_t g = 0; g < num_kv_heads; ++g)
        tasks.push_back({starts[r] + j, tokens, r, first_pos + j, g, q_len == 1, rows * keys});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const AttentionTask& a, const AttentionTask& b) { return a.cost > b.cost; });
  return tasks;
}

// Causal attention of query rows against the paged cache (q: row i's heads at
// q + i * q_row_stride, [heads, head_dim]); writes out [rows, heads * head_dim]. Decode tokens
// read their context once for the query heads of a KV head (`attend`); prefill tasks once for
// a tile of tokens (`attend_prefill`). The threads take tasks, largest first, from a shared
// counter: a causal chunk's later tiles read more keys than its first ones.
void attend_tasks(const float* q, int64_t q_row_stride, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_table,
                  const std::vector<AttentionTask>& tasks, int64_t num_heads, int64_t block_size,
                  float scale, float* out) {
  const int64_t num_kv_heads = key_cache.size(1), head_dim = key_cache.size(2);
  TORCH_CHECK(head_dim % 16 == 0, "attention: head_dim must be a multiple of 16");
  const int64_t group = num_heads / num_kv_heads, width = block_table.size(1);
  const float* keys = key_cache.data_ptr<float>();
  const float* values = value_cache.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  skiff_cpu::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < num_tasks; i = next++) {
      const AttentionTask& t = tasks[i];
      const float* q_rows = q + t.row * q_row_stride + t.kv_head * group * head_dim;
      float* out_rows = out + (t.row * num_heads + t.kv_head * group) * head_dim;
      const int32_t* request_table = table + t.request * width;
      if (t.decode) {
        scratch.resize(group * (t.first_pos + 1));
        skiff_cpu::kernels().attend(q_rows, group, keys, values, request_table, t.first_pos + 1,
                          block_size, num_kv_heads, t.kv_head, head_dim, scale, scratch.data(),
                          out_rows, head_dim);
      } else {
        scratch.resize(skiff_cpu::prefill_scratch_floats(head_dim));
        skiff_cpu::kernels().attend_prefill(q_rows, q_row_stride, t.tokens, group, t.first_pos, keys,
                                  values, request_table, block_size, num_kv_heads, t.kv_head,
                                  head_dim, scale, scratch.data(), out_rows,
                                  num_heads * head_dim);
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query,        // [T, heads, head_dim]
                           const at::Tensor& key_cache,    // [num_slots, kv_heads, head_dim]
                           const at::Tensor& value_cache,  // [num_slots, kv_heads, head_dim]
                           const at::Tensor& query_start_loc,  // [R + 1] int32
                           const at::Tensor& seq_lens,         // [R] int32
                           const at::Tensor& block_table,      // [R, max_blocks] int32
                           double scale, int64_t block_size) {
  TORCH_CHECK(*skiff_cpu::isa(), "paged_attention needs AVX2 or AVX-512");
  for (const at::Tensor* t : {&query, &key_cache, &value_cache})
    TORCH_CHECK(is_fp32_cpu(*t) && t->is_contiguous(),
                "paged_attention takes contiguous fp32 CPU tensors");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "paged_attention: int32 query_start_loc, seq_lens and contiguous block_table");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(1);
  const auto tasks =
      attention_tasks(query_start_loc.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                      seq_lens.size(0), num_heads / num_kv_heads, num_kv_heads);
  at::Tensor out = at::empty_like(query);
  attend_tasks(query.data_ptr<float>(), num_heads * query.size(2), key_cache, value_cache,
               block_table, tasks, num_heads, block_size, static_cast<float>(scale),
               out.data_ptr<float>());
  return out;
}

// rms_norm(x [T, H], weight, eps, residual) -> (rms_norm(x + residual) * weight, x + residual).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(is_fp32_cpu(x) && is_fp32_cpu(weight) && x.dim() == 2, "rms_norm: fp32 [T, H]");
  at::Tensor sum = residual.has_value() && residual->defined() ? x + *residual : x.contiguous();
  at::Tensor out = at::empty_like(sum);
  const int64_t H = sum.size(1);
  const at::Tensor w = weight.contiguous();
  skiff_cpu::parallel_for(0, sum.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      skiff_cpu::kernels().rms_norm_row(sum.data_ptr<float>() + t * H, w.data_ptr<float>(),
                              out.data_ptr<float>() + t * H, H, static_cast<float>(eps));
  });
  return {out, sum};
}

// Neox rotary on query [T, heads, head_dim] and key [T, kv_heads, head_dim] at `positions`
// (rows of cos_sin_cache [max_position, rot_dim]); returns rotated copies.
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions,
                                                    const at::Tensor& query,
                                                    const at::Tensor& key,
                                                    const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(is_fp32_cpu(query) && is_fp32_cpu(key) && is_fp32_cpu(cos_sin_cache) &&
                  positions.scalar_type() == at::kLong,
              "rotary_embedding: fp32 query, key and cache, int64 positions");
  at::Tensor q = query.contiguous().clone(), k = key.contiguous().clone();
  const at::Tensor cache = cos_sin_cache.contiguous(), pos = positions.contiguous();
  const int64_t rot_dim = cache.size(1), head_dim = q.size(2);
  TORCH_CHECK(rot_dim <= head_dim && k.size(2) == head_dim, "rotary_embedding: head sizes");
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  skiff_cpu::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cache.data_ptr<float>() + pos.data_ptr<int64_t>()[t] * rot_dim;
      for (int64_t h = 0; h < q_heads; ++h)
        skiff_cpu::kernels().rotate_head(q.data_ptr<float>() + (t * q_heads + h) * head_dim, cs, rot_dim);
      for (int64_t h = 0; h < k_heads; ++h)
        skiff_cpu::kernels().rotate_head(k.data_ptr<float>() + (t * k_heads + h) * head_dim, cs, rot_dim);
    }
  });
  return {q, k};
}

// silu_and_mul(x [T, 2 I]) = silu(x[:, :I]) * x[:, I:].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(is_fp32_cpu(x) && x.dim() == 2, "silu_and_mul: fp32 [T, 2 I]");
  const at::Tensor in = x.contiguous();
  const int64_t inter = in.size(1) / 2;
  at::Tensor out = at::empty({in.size(0), inter}, in.options());
  skiff_cpu::parallel_for(0, in.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      skiff_cpu::kernels().silu_and_mul_row(in.data_ptr<float>() + t * 2 * inter,
                                  out.data_ptr<float>() + t * inter, inter);
  });
  return out;
}

constexpr int64_t kLayerLoRA = 8;  // (lora_a, lora_b) of qkv, o, gate_up and down

// One layer of decode_layers.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden,      // [B, H]
    const at::Tensor& residual,    // [B, H]
    const at::Tensor& input_norm,  // [H]
    const at::Tensor& qkv_weight,  // [(heads + 2 kv_heads) * head_dim, H] (or its panels)
    const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& q_norm,  // [head_dim]
    const std::optional<at::Tensor>& k_norm,  // [head_dim]
    const at::Tensor& cos_sin,       // [B, rot_dim]: cos/sin cache rows at the positions
    const at::Tensor& key_cache,     // [num_slots, kv_heads, head_dim]
    const at::Tensor& value_cache,   // [num_slots, kv_heads, head_dim]
    const at::Tensor& slot_mapping,  // [B] int64
    const at::Tensor& block_table,   // [B, max_blocks] int32
    const at::Tensor& seq_lens,      // [B] int32, the new token included
    const at::Tensor& o_weight,      // [H, heads * head_dim]
    const at::Tensor& post_norm,     // [H]
    const at::Tensor& gate_up_weight,  // [2 I, H]
    const at::Tensor& down_weight,     // [H, I]: each of the four [N, K] or its panels
    const std::optional<at::Tensor>& qkv_scale,  // int8 weights' group scales
    const std::optional<at::Tensor>& o_scale,
    const std::optional<at::Tensor>& gate_up_scale,
    const std::optional<at::Tensor>& down_scale,
    double eps, double scale, int64_t num_heads, int64_t block_size,
    at::TensorList lora,  // [] or 4 x (lora_a [S, n R, K], lora_b panels [S, P, R, 16])
    const std::optional<at::Tensor>& lora_slots) {  // [B] int32: each token's slot, -1: none
  TORCH_CHECK(*skiff_cpu::isa(), "decode_layers needs AVX2 or AVX-512");
  TORCH_CHECK(lora.empty() || (static_cast<int64_t>(lora.size()) == kLayerLoRA &&
                                lora_slots.has_value()),
              "decode_layers: LoRA takes ", kLayerLoRA, " tensors and the tokens' slots");
  for (const at::Tensor* t :
       {&hidden, &residual, &input_norm, &cos_sin, &key_cache, &value_cache, &post_norm}) {
    TORCH_CHECK(is_fp32_cpu(*t) && t->is_contiguous(),
                "decode_layers takes contiguous fp32 CPU tensors");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_table.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt && block_table.is_contiguous(),
              "decode_layers: int64 slot_mapping, contiguous int32 block_table and seq_lens");
  const int64_t batch = hidden.size(0);
  const int64_t num_kv_heads = key_cache.size(1), head_dim = key_cache.size(2);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t rot_dim = cos_sin.size(1);
  TORCH_CHECK(rot_dim <= head_dim, "decode_layers: rotary size exceeds head_dim");
  const int64_t H = hidden.size(1), I = in_features(down_weight);
  const LayerLoRA adapters{lora, lora_slots, {{{q_size, kv_size, kv_size}, {H}, {I, I}, {H}}}};

  // Residual add, RMSNorm, QKV projection.
  auto [normed, x] = rms_norm(hidden, input_norm, eps, residual);
  at::Tensor qkv = project(normed, qkv_weight, qkv_scale, q_size + 2 * kv_size);  // [B, q + 2 kv]
  if (qkv_bias.has_value() && qkv_bias->defined()) qkv.add_(*qkv_bias);
  adapters.add(0, qkv, normed);

  // Per-head q/k norm and rotary; the new keys and values into the cache.
  float* qkv_p = qkv.data_ptr<float>();
  const int64_t row = q_size + 2 * kv_size;
  const bool qk_norm = q_norm.has_value() && q_norm->defined();
  const auto* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const float* cs = cos_sin.data_ptr<float>() + b * rot_dim;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* head = qkv_p + b * row + h * head_dim;
      if (qk_norm) {
        const at::Tensor& w = h < num_heads ? *q_norm : *k_norm;
        skiff_cpu::kernels().rms_norm_row(head, w.data_ptr<float>(), head, head_dim,
                                static_cast<float>(eps));
      }
      skiff_cpu::kernels().rotate_head(head, cs, rot_dim);
    }
    const int64_t dst = slots[b] * kv_size;
    std::copy_n(qkv_p + b * row + q_size, kv_size, key_cache.data_ptr<float>() + dst);
    std::copy_n(qkv_p + b * row + q_size + kv_size, kv_size, value_cache.data_ptr<float>() + dst);
  }

  // Paged attention straight from the cache.
  at::Tensor attn = at::empty({batch, q_size}, hidden.options());  // [B, heads * head_dim]
  std::vector<int32_t> starts(batch + 1);
  std::iota(starts.begin(), starts.end(), 0);  // one query token per request
  const auto tasks = attention_tasks(starts.data(), seq_lens.data_ptr<int32_t>(), batch,
                                     num_heads / num_kv_heads, num_kv_heads);
  attend_tasks(qkv_p, row, key_cache, value_cache, block_table, tasks, num_heads, block_size,
               static_cast<float>(scale), attn.data_ptr<float>());

  // Output projection, residual add, RMSNorm, MLP.
  at::Tensor attn_out = project(attn, o_weight, o_scale, H);  // [B, H]
  adapters.add(1, attn_out, attn);
  auto [normed2, x2] = rms_norm(attn_out, post_norm, eps, x);
  at::Tensor gate_up = project(normed2, gate_up_weight, gate_up_scale, 2 * I);  // [B, 2 I]
  adapters.add(2, gate_up, normed2);
  at::Tensor act = silu_and_mul(gate_up);  // [B, I]
  at::Tensor out = project(act, down_weight, down_scale, H);
  adapters.add(3, out, act);
  return {out, x2};
}

// A layer's entries in decode_layers' `weights`, in this order; those of decode_layer that may
// be None are optional here too.
enum LayerWeight : int64_t {
  kInputNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kPostNorm, kGateUp, kDown,
  kQkvScale, kOScale, kGateUpScale, kDownScale, kLayerWeights
};

// decode_layer over every layer: one call per step instead of one per layer (the dispatcher
// takes ~5 us a call from Python, ~4% of a single-stream q8_0 step over 30 layers).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, const at::Tensor& residual,
    const c10::List<std::optional<at::Tensor>>& weights,  // kLayerWeights per layer
    const at::Tensor& cos_sin, at::TensorList key_caches, at::TensorList value_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& seq_lens,
    double eps, double scale, int64_t num_heads, int64_t block_size,
    at::TensorList lora,  // [] or kLayerLoRA per layer
    const std::optional<at::Tensor>& lora_slots) {
  const auto layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kLayerWeights,
              "decode_layers: a key cache, a value cache and ", kLayerWeights,
              " weights per layer");
  TORCH_CHECK(lora.empty() || static_cast<int64_t>(lora.size()) == layers * kLayerLoRA,
              "decode_layers: LoRA takes ", kLayerLoRA, " tensors per layer");
  at::Tensor h = hidden, r = residual;
  for (int64_t l = 0; l < layers; ++l) {
    auto weight = [&](LayerWeight i) -> std::optional<at::Tensor> {
      return weights.get(l * kLayerWeights + i);
    };
    auto required = [&](LayerWeight i) -> at::Tensor {
      std::optional<at::Tensor> t = weight(i);
      TORCH_CHECK(t.has_value() && t->defined(), "decode_layers: a layer lacks a norm or weight");
      return *t;
    };
    const at::TensorList adapters = lora.empty() ? lora : lora.slice(l * kLayerLoRA, kLayerLoRA);
    std::tie(h, r) = decode_layer(
        h, r, required(kInputNorm), required(kQkv), weight(kQkvBias), weight(kQNorm),
        weight(kKNorm), cos_sin, key_caches[l], value_caches[l], slot_mapping, block_table,
        seq_lens, required(kO), required(kPostNorm), required(kGateUp), required(kDown),
        weight(kQkvScale), weight(kOScale), weight(kGateUpScale), weight(kDownScale), eps, scale,
        num_heads, block_size, adapters, lora_slots);
  }
  return {h, r};
}

}  // namespace

TORCH_LIBRARY(skiff_cpu, m) {
  m.def("isa() -> str", [] { return std::string(skiff_cpu::isa()); });
  m.def("use_isa(str name) -> bool",
        [](const std::string& name) { return skiff_cpu::use_isa(name.c_str()); });
  m.def("int8_dot_isa() -> str", [] { return std::string(skiff_cpu::int8_dot_isa()); });
  m.def("bf16_dot_isa() -> str", [] { return std::string(skiff_cpu::bf16_dot_isa()); });
  m.def("use_bf16_dot_isa(str name) -> bool",
        [](const std::string& name) { return skiff_cpu::use_bf16_dot_isa(name.c_str()); });
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? weight_scale=None) -> "
      "Tensor");
  m.def(
      "linear_packed(Tensor x, Tensor packed, int out_features, Tensor? bias=None, "
      "Tensor? scale=None) -> Tensor");
  m.def(
      "decode_layers(Tensor hidden, Tensor residual, Tensor?[] weights, Tensor cos_sin, "
      "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor slot_mapping, "
      "Tensor block_table, Tensor seq_lens, float eps, float scale, int num_heads, "
      "int block_size, Tensor[] lora, Tensor? lora_slots) -> (Tensor, Tensor)");
  m.def(
      "add_lora(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b_panels, Tensor slots, "
      "int[] slice_sizes) -> ()");
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, float scale, "
      "int block_size) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def(
      "rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache) -> "
      "(Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(skiff_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_packed", &linear_packed);
  m.impl("decode_layers", &decode_layers);
  m.impl("add_lora", [](at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a,
                        const at::Tensor& lora_b, const at::Tensor& slots,
                        at::IntArrayRef slice_sizes) {
    add_lora_into(y, x, lora_a, lora_b, slots, slice_sizes);
  });
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
