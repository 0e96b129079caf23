// The int8 dot products of the Q8_0 x Q8_0 kernel (q8_bodies.h) for AVX512-VNNI, after
// simd_avx512.h: the 4 bytes of one k-quad of x, broadcast, against 16 lanes of 4 weight bytes,
// added exactly into 16 int32 lanes by one vpdpbusd. vpdpbusd sums in int32 (no 16-bit
// pairs to saturate), so x goes in biased, x + 128 as unsigned bytes, with no sign trick (which
// costs a masked negation of the weights per row: AVX-512 has no vpsignb): the kernel takes
// 128 times the group's weight sums (Q8Bias) back off, and the int32 sums are exactly those of
// the AVX2 kernel.
constexpr int kQ8Rows = 6;    // rows of x per Q8_0 register tile
constexpr int kQ8Panels = 2;  // panels per Q8_0 register tile
struct XQuad {
  IVec biased;
};
inline IVec ivzero() { return _mm512_setzero_si512(); }
inline IVec ivload_bytes(const int8_t* p) { return _mm512_loadu_si512(p); }
inline XQuad xquad(const int8_t* p) {  // p: 4 biased bytes (vstore_xq)
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  return {_mm512_set1_epi32(quad)};
}
inline IVec idot(IVec acc, const XQuad& x, IVec w) { return _mm512_dpbusd_epi32(acc, x.biased, w); }
struct Q8Bias {
  static constexpr bool kOn = true;
  static IVec weight_sum(IVec acc, IVec w) { return _mm512_dpbusd_epi32(acc, _mm512_set1_epi8(1), w); }
  static IVec remove(IVec dot, IVec weight_sum) {  // dot - 128 weight_sum
    return _mm512_sub_epi32(dot, _mm512_slli_epi32(weight_sum, 7));
  }
};
inline Vec vcvt(IVec v) { return _mm512_cvtepi32_ps(v); }
inline float vmax_all(Vec v) { return _mm512_reduce_max_ps(v); }
// W quantized x (integral, in [-127, 127]) as xquad reads them: x + 128, unsigned bytes.
inline void vstore_xq(int8_t* p, Vec v) {
  const __m128i q = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_xor_si128(q, _mm_set1_epi8(-128)));
}
