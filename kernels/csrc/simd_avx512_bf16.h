// The bf16 dot products of the bf16 x bf16 kernel (bf16_bodies.h) for AVX512-BF16, after
// simd_avx512.h: one k-pair of x, broadcast, against 16 lanes of 2 weights, added into 16
// fp32 lanes by one vdpbf16ps (the odd product first, then the even one, as cpu_kernels.h
// says). vdpbf16ps flushes what falls below fp32's normal range by itself.
constexpr int kBf16Rows = 6;  // rows of x per bf16 register tile
constexpr int kWPairRegisters = 1;  // registers a WPair holds
struct WPair {
  __m512bh pairs;
};
struct XPair {
  __m512bh pair;
};
struct DenormalsFlushed {};  // vdpbf16ps always flushes
inline WPair wpair(const uint16_t* p) {
  return {reinterpret_cast<__m512bh>(_mm512_loadu_si512(p))};
}
inline XPair xpair(const uint16_t* p) {  // p: x[2 j], x[2 j + 1]
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return {reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair))};
}
inline Vec bdot(Vec acc, const XPair& x, const WPair& w) {
  return _mm512_dpbf16_ps(acc, x.pair, w.pairs);
}
