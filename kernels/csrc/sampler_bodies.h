// The bodies of sampler_kernels.h, written once over a vector vocabulary (simd_avx512.h or
// simd_avx2.h, then the sampler's own lane helpers: banned_lanes, ban, nan_lanes, ...).
// Each sampler_<isa>.cpp includes them inside its own namespace and target region. No include
// guard: included once per instruction set.

namespace {

constexpr int64_t kBlockVecs = kLogitBlock / W;
constexpr int64_t kSumVecs = 16;  // vectors summed in fp32 before their sum joins the fp64 total
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x lanewise for the x a logsumexp meets: x <= 0 (a logit less its row's maximum), -inf
// and anything below -87 -> 0, +inf -> inf, NaN -> NaN. (max and min keep a NaN only in their
// second operand.)
inline Vec exp_lanes(Vec x) {
  const Vec c = vmin(vset1(89.0f), vmax(vset1(-87.0f), x));  // 2^n for n in [-126, 128]
  return zero_below(exp_clamped(c), x, vset1(-87.0f));
}

// Block maxima of x's whole blocks (and the masked copy into out, where given); returns the
// maximum of the whole row, tail included (NaN if any value is NaN). The copy bypasses the
// cache (streaming stores) where out is vector-aligned: no read of out's lines before they
// are written, and the 50 MB of a batch would not stay in cache anyway.
float block_maxima(const float* x, const bool* banned, float* out, int64_t vocab,
                   float* block_max) {
  const int64_t blocks = vocab / kLogitBlock;
  const bool stream = reinterpret_cast<uintptr_t>(out) % sizeof(Vec) == 0;
  Vec row_max = vset1(kNegInf);
  bool any_nan = false;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kLogitBlock;
    Vec m = vset1(kNegInf);
    Mask nan = no_lanes();
    for (int64_t v = 0; v < kBlockVecs; ++v) {
      const int64_t t = at + v * W;
      const Vec xv = vload(x + t);
      if (out != nullptr) {
        const Vec masked = banned == nullptr ? xv : ban(xv, banned_lanes(banned + t));
        if (stream)
          vstream(out + t, masked);
        else
          vstore(out + t, masked);
      }
      m = vmax(m, xv);
      nan = lanes_or(nan, nan_lanes(xv));
    }
    const bool block_nan = any_lane(nan);
    any_nan |= block_nan;
    block_max[b] = block_nan ? std::numeric_limits<float>::quiet_NaN() : vmax_all(m);
    row_max = vmax(row_max, m);
  }
  float top = vmax_all(row_max);
  for (int64_t t = blocks * kLogitBlock; t < vocab; ++t) {
    if (out != nullptr) out[t] = banned != nullptr && banned[t] ? kNegInf : x[t];
    any_nan |= std::isnan(x[t]);
    top = std::max(top, x[t]);
  }
  if (out != nullptr && stream) _mm_sfence();  // the streamed copy before anyone reads it
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : top;
}

// sum(e^(x - shift)) over the row: fp32 sums of kSumVecs vectors, added up in fp64.
double sum_exp(const float* x, int64_t vocab, float shift) {
  const Vec s = vset1(shift);
  double total = 0;
  int64_t t = 0;
  for (; t + kSumVecs * W <= vocab; t += kSumVecs * W) {
    Vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
    for (int64_t v = 0; v < kSumVecs; ++v)
      acc[v % 4] = vadd(acc[v % 4], exp_lanes(vsub(vload(x + t + v * W), s)));
    total += static_cast<double>(vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3]))));
  }
  for (; t < vocab; ++t) total += std::exp(static_cast<double>(x[t]) - shift);
  return total;
}

void logit_row(const float* x, const bool* banned, float* out, int64_t vocab, float* block_max,
               float* lse) {
  const float top = block_maxima(x, banned, out, vocab, block_max);
  const float shift = std::isinf(top) ? 0.0f : top;  // NaN stays NaN
  *lse = static_cast<float>(std::log(sum_exp(x, vocab, shift)) + shift);
}

// The first index of the row's maximum, or of its first NaN where it holds one (torch.argmax):
// the block maxima, then the first block whose maximum is the row's, then that block's values.
int64_t argmax_row(const float* x, int64_t vocab, float* block_max) {
  const float top = block_maxima(x, nullptr, nullptr, vocab, block_max);
  int64_t from = 0;
  if (!std::isnan(top)) {
    const int64_t blocks = vocab / kLogitBlock;
    while (from < blocks && block_max[from] != top) ++from;
    from *= kLogitBlock;
  }
  for (int64_t t = from; t < vocab; ++t)
    if (x[t] == top || (std::isnan(top) && std::isnan(x[t]))) return t;
  return 0;  // not reached: top is one of x's values
}

}  // namespace

const SamplerKernels sampler_kernels = {logit_row, argmax_row};
