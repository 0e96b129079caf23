// The Q8_0 x Q8_0 kernels of cpu_kernels.h (Q8Kernels: quantize_q8, linear_q8_panels),
// written once over a vector vocabulary (simd_avx2.h, or simd_avx512.h with
// simd_avx512_vnni.h: Vec, IVec, XQuad, xquad, idot, Q8Bias, vcvt, vmax_all, vstore_xq).
// Included by avx2_kernels.cpp and vnni_kernels.cpp inside their own namespace and target
// region. No include guard: included once per instruction set.

#include "tile_store.h"

namespace {

constexpr int kQ8Vecs = static_cast<int>(kPanel / W);  // int32 vectors across a panel
constexpr int64_t kQ8QuadsPerGroup = kInt8Group / kQ8Quad;
constexpr int64_t kQ8ChunkBytes = 256 << 10;  // panels kept in L2 while the row tiles pass

// y[m, n0 + c] for m < MR, c < NP kPanel (clipped at N): panel p's weights at w + p K kPanel,
// its scales at scale + p (K / kInt8Group) kPanel. Per group: the exact int32 dot products of
// its kQ8QuadsPerGroup quads (each weight load used by all MR rows), then one fma per output.
template <int MR, int NP, typename Bias = Q8Bias>
inline void q8_tile(const int8_t* xq, const float* x_scale, const int8_t* w, const float* scale,
                    float* y, int64_t K, int64_t N, int64_t n0) {
  constexpr int V = NP * kQ8Vecs;
  const int64_t groups = K / kInt8Group;
  Vec acc[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) acc[m][j] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    IVec dots[MR][V], weight_sums[V];
    for (int j = 0; j < V; ++j) weight_sums[j] = ivzero();
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < V; ++j) dots[m][j] = ivzero();
    for (int64_t q = 0; q < kQ8QuadsPerGroup; ++q) {
      const int64_t k = g * kInt8Group + q * kQ8Quad;
      IVec wv[V];
      for (int p = 0; p < NP; ++p)
        for (int v = 0; v < kQ8Vecs; ++v)
          wv[p * kQ8Vecs + v] = ivload_bytes(w + p * K * kPanel + k * kPanel + v * W * kQ8Quad);
      if constexpr (Bias::kOn)
        for (int j = 0; j < V; ++j) weight_sums[j] = Bias::weight_sum(weight_sums[j], wv[j]);
      for (int m = 0; m < MR; ++m) {
        const XQuad xv = xquad(xq + m * K + k);
        for (int j = 0; j < V; ++j) dots[m][j] = idot(dots[m][j], xv, wv[j]);
      }
    }
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kQ8Vecs; ++v) {
        const int j = p * kQ8Vecs + v;
        const Vec ws = vload(scale + (p * groups + g) * kPanel + v * W);
        for (int m = 0; m < MR; ++m) {
          const Vec d = vmul(ws, vset1(x_scale[m * groups + g]));
          IVec dot = dots[m][j];
          if constexpr (Bias::kOn) dot = Bias::remove(dot, weight_sums[j]);
          acc[m][j] = vfmadd(vcvt(dot), d, acc[m][j]);
        }
      }
  }
  store_tile(acc, y, N, n0, std::min<int64_t>(NP * kPanel, N - n0));
}

// Rows [0, MR) of x against panels [p_begin, p_end): tiles of kQ8Panels panels, then one.
template <int MR>
void q8_rows(const int8_t* xq, const float* x_scale, const int8_t* packed, const float* scale,
             float* y, int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  const int64_t groups = K / kInt8Group;
  int64_t p = p_begin;
  for (; p + kQ8Panels <= p_end; p += kQ8Panels)
    q8_tile<MR, kQ8Panels>(xq, x_scale, packed + p * K * kPanel, scale + p * groups * kPanel, y,
                           K, N, p * kPanel);
  for (; p < p_end; ++p)
    q8_tile<MR, 1>(xq, x_scale, packed + p * K * kPanel, scale + p * groups * kPanel, y, K, N,
                   p * kPanel);
}

template <size_t... I>
constexpr auto q8_row_variants(std::index_sequence<I...>) {
  return std::array{&q8_rows<static_cast<int>(I) + 1>...};
}
constexpr auto kQ8RowVariants =
    q8_row_variants(std::make_index_sequence<static_cast<size_t>(kQ8Rows)>{});

void quantize_q8(const float* x, int8_t* xq, float* x_scale, int64_t groups) {
  constexpr int V = static_cast<int>(kInt8Group / W);
  for (int64_t g = 0; g < groups; ++g) {
    const float* src = x + g * kInt8Group;
    Vec amax = vzero();
    for (int v = 0; v < V; ++v) {
      const Vec xv = vload(src + v * W);
      amax = vmax(amax, vmax(xv, vsub(vzero(), xv)));
    }
    const float s = vmax_all(amax) / 127.0f;
    x_scale[g] = s;
    const Vec d = vset1(s > 0.0f ? s : 1.0f);  // s == 0: the group is all zeros
    for (int v = 0; v < V; ++v) {
      const Vec q = vround(vdiv(vload(src + v * W), d));
      vstore_xq(xq + g * kInt8Group + v * W, vmin(vmax(q, vset1(-127.0f)), vset1(127.0f)));
    }
  }
}

// Chunks of panels that stay in L2; in each, all rows in tiles of kQ8Rows (then the rest).
void linear_q8_panels(const int8_t* xq, const float* x_scale, const int8_t* packed,
                      const float* scale, float* y, int64_t M, int64_t K, int64_t N,
                      int64_t p_begin, int64_t p_end) {
  const int64_t chunk = std::max<int64_t>(kQ8Panels, kQ8ChunkBytes / (K * kPanel));
  const int64_t groups = K / kInt8Group;
  for (int64_t p0 = p_begin; p0 < p_end; p0 += chunk) {
    const int64_t p1 = std::min(p_end, p0 + chunk);
    for (int64_t m = 0; m < M; m += kQ8Rows) {
      const int64_t rows = std::min<int64_t>(kQ8Rows, M - m);
      kQ8RowVariants[rows - 1](xq + m * K, x_scale + m * groups, packed, scale, y + m * N, K, N,
                               p0, p1);
    }
  }
}

}  // namespace

const Q8Kernels q8_kernels = {quantize_q8, linear_q8_panels};
