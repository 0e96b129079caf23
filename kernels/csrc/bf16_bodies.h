// The bf16 x bf16 kernels of cpu_kernels.h (Bf16Kernels: round, linear_bf16_panels), written
// once over a vector vocabulary (simd_avx512.h with simd_avx512_bf16.h, or simd_avx512.h /
// simd_avx2.h with simd_bf16_split.h: Vec, WPair, XPair, wpair, xpair, bdot,
// DenormalsFlushed, kBf16Rows, kWPairRegisters). Included by bf16_kernels.cpp,
// avx512_kernels.cpp and avx2_kernels.cpp inside their own namespace and target region. No
// include guard: included once per instruction set.

#include "tile_store.h"

namespace {

constexpr int kBf16Vecs = static_cast<int>(kPanel / W);  // vectors across a panel
constexpr int64_t kBf16ChunkBytes = 256 << 10;  // panels kept in L2 while the row tiles pass

// Panels side by side in a tile of `rows` rows: as many as the registers hold (accumulators,
// the weights of one pair, x's pair), at most 4.
constexpr int bf16_panels_per_tile(int rows) {
  const int n = (kVecRegisters - kWPairRegisters) / ((rows + kWPairRegisters) * kBf16Vecs);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

// y[m, n0 + c] for m < MR, c < NP kPanel (clipped at N): panel p's pairs at w + p K kPanel.
// Each step loads a pair of the panels' weights once and multiplies it into all MR rows.
template <int MR, int NP>
inline void bf16_tile(const uint16_t* xb, const uint16_t* w, float* y, int64_t K, int64_t N,
                      int64_t n0) {
  constexpr int V = NP * kBf16Vecs;
  Vec acc[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < V; ++j) acc[m][j] = vzero();
  for (int64_t k = 0; k < K; k += kBf16Pair) {
    WPair wv[V];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kBf16Vecs; ++v)
        wv[p * kBf16Vecs + v] = wpair(w + p * K * kPanel + k * kPanel + v * W * kBf16Pair);
    for (int m = 0; m < MR; ++m) {
      const XPair xv = xpair(xb + m * K + k);
      for (int j = 0; j < V; ++j) acc[m][j] = bdot(acc[m][j], xv, wv[j]);
    }
  }
  store_tile(acc, y, N, n0, std::min<int64_t>(NP * kPanel, N - n0));
}

// Rows [0, MR) of x against panels [p_begin, p_end): tiles of bf16_panels_per_tile(MR)
// panels, then one at a time.
template <int MR>
void bf16_rows(const uint16_t* xb, const uint16_t* packed, float* y, int64_t K, int64_t N,
               int64_t p_begin, int64_t p_end) {
  constexpr int NP = bf16_panels_per_tile(MR);
  int64_t p = p_begin;
  for (; p + NP <= p_end; p += NP)
    bf16_tile<MR, NP>(xb, packed + p * K * kPanel, y, K, N, p * kPanel);
  for (; p < p_end; ++p) bf16_tile<MR, 1>(xb, packed + p * K * kPanel, y, K, N, p * kPanel);
}

template <size_t... I>
constexpr auto bf16_row_variants(std::index_sequence<I...>) {
  return std::array{&bf16_rows<static_cast<int>(I) + 1>...};
}
constexpr auto kBf16RowVariants =
    bf16_row_variants(std::make_index_sequence<static_cast<size_t>(kBf16Rows)>{});

void round_bf16(const float* x, uint16_t* xb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof(u));
    const uint32_t magnitude = u & 0x7fffffffu;
    uint32_t r;
    if (magnitude < 0x00800000u)  // zero or below the normal range: zero, sign kept
      r = (u >> 16) & 0x8000u;
    else if (magnitude > 0x7f800000u)  // NaN: quiet
      r = (u >> 16) | 0x0040u;
    else  // to nearest, ties to even (a carry into the exponent is right, up to infinity)
      r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    xb[i] = static_cast<uint16_t>(r);
  }
}

// Chunks of panels that stay in L2; in each, all rows in tiles of kBf16Rows (then the rest).
void linear_bf16_panels(const uint16_t* xb, const uint16_t* packed, float* y, int64_t M,
                        int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  [[maybe_unused]] const DenormalsFlushed flushed;  // MXCSR as vdpbf16ps has it, until return
  const int64_t panel_bytes = K * kPanel * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t chunk = std::max<int64_t>(4, kBf16ChunkBytes / panel_bytes);
  for (int64_t p0 = p_begin; p0 < p_end; p0 += chunk) {
    const int64_t p1 = std::min(p_end, p0 + chunk);
    for (int64_t m = 0; m < M; m += kBf16Rows) {
      const int64_t rows = std::min<int64_t>(kBf16Rows, M - m);
      kBf16RowVariants[rows - 1](xb + m * K, packed, y + m * N, K, N, p0, p1);
    }
  }
}

}  // namespace

const Bf16Kernels bf16_kernels = {round_bf16, linear_bf16_panels};
