// The int8 dot products of the Q8_0 x Q8_0 kernel (q8_bodies.h) for AVX512-VNNI, after
// simd_avx512.h: the 4 bytes of one k-quad of x, broadcast, against 16 lanes of 4 weight bytes,
// added exactly into 16 int32 lanes by one vpdpbusd. The sign trick as in simd_avx2.h: |x|
// (unsigned) times w negated where x < 0 (AVX-512 has no vpsignb: a masked subtraction), so
// the int32 sums are those of the AVX2 kernel.
constexpr int kQ8Rows = 4;    // rows of x per Q8_0 register tile
constexpr int kQ8Panels = 2;  // panels per Q8_0 register tile
struct XQuad {
  IVec magnitude;
  __mmask64 negative;
};
inline IVec ivzero() { return _mm512_setzero_si512(); }
inline IVec ivload_bytes(const int8_t* p) { return _mm512_loadu_si512(p); }
inline XQuad xquad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  const IVec b = _mm512_set1_epi32(quad);
  return {_mm512_abs_epi8(b), _mm512_movepi8_mask(b)};
}
inline IVec idot(IVec acc, const XQuad& x, IVec w) {
  const IVec signed_w = _mm512_mask_sub_epi8(w, x.negative, _mm512_setzero_si512(), w);
  return _mm512_dpbusd_epi32(acc, x.magnitude, signed_w);
}
inline Vec vcvt(IVec v) { return _mm512_cvtepi32_ps(v); }
