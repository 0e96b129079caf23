// The vector vocabulary of kernel_bodies.h for AVX2 with FMA: 8 floats per vector, 16
// registers. Included by avx2_kernels.cpp only, inside its namespace and target region.
using Vec = __m256;
using IVec = __m256i;
using Mask = __m256;  // all-ones lanes take part
constexpr int64_t W = 8;
constexpr int kTokensPerTile = 2;  // rows of x per linear register tile (16 registers)
constexpr int kAccumulators = 8;   // vector accumulators a prefill tile may hold
constexpr int kVecRegisters = 16;
constexpr int kPanelRows = 6;      // rows of x per panel tile: 6 x 2 accumulators

inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }   // a * b + c
inline Vec vfnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); } // c - a * b
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vscale2(Vec p, Vec n) {  // p * 2^n for integral n in [-126, 127]: 2^n built as bits
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(p, _mm256_castsi256_ps(bits));
}

// W bf16 (fp32's top half) or int8 values as fp32.
inline Vec vload_bf16(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline Vec vload_int8(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

// A vector of W bf16 pairs (2 W values, lane i: values 2 i and 2 i + 1) as the fp32 of the
// even and of the odd values: a shift, a mask.
inline Vec vbf16_even(Vec pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(pairs), 16));
}
inline Vec vbf16_odd(Vec pairs) {
  const auto high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(pairs), high));
}

// Weights k..k+W-1 of a row as fp32 (`scale`: the row's int8 group scales).
inline Vec vload_weights(const float* row, int64_t k, const float*) { return vload(row + k); }
inline Vec vload_weights(const uint16_t* row, int64_t k, const float*) { return vload_bf16(row + k); }
inline Vec vload_weights(const int8_t* row, int64_t k, const float* scale) {
  return vmul(vload_int8(row + k), vset1(scale[k / kInt8Group]));
}

inline IVec vload_int(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Mask mask_all() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
inline Mask mask_le(int32_t key, IVec pos) {  // lanes with key <= pos, i.e. pos > key - 1
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, _mm256_set1_epi32(key - 1)));
}
inline Vec mask_max(Vec a, Mask m, Vec b) { return _mm256_blendv_ps(a, vmax(a, b), m); }
inline Vec zero_unless(Mask m, Vec v) { return _mm256_and_ps(m, v); }

// The int8 dot products of the Q8_0 x Q8_0 kernel (q8_bodies.h): the 4 bytes of one k-quad of
// x, broadcast, against W lanes of 4 weight bytes, added exactly into W int32 lanes. The sign
// trick: vpmaddubsw multiplies |x| (unsigned) by w with x's sign (vpsignb), so each pair sum is
// at most 2 127^2 and never saturates; vpmaddwd by ones adds the pairs into int32.
constexpr int kQ8Rows = 2;    // rows of x per Q8_0 register tile
constexpr int kQ8Panels = 1;  // panels per Q8_0 register tile
struct XQuad {
  IVec magnitude, sign;
};
inline IVec ivzero() { return _mm256_setzero_si256(); }
inline IVec ivload_bytes(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline XQuad xquad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof(quad));
  const IVec b = _mm256_set1_epi32(quad);
  return {_mm256_abs_epi8(b), b};
}
inline IVec idot(IVec acc, const XQuad& x, IVec w) {
  const IVec pairs = _mm256_maddubs_epi16(x.magnitude, _mm256_sign_epi8(w, x.sign));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
struct Q8Bias {  // x goes in unbiased
  static constexpr bool kOn = false;
};
inline Vec vcvt(IVec v) { return _mm256_cvtepi32_ps(v); }
inline float vmax_all(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// W quantized x (integral, in [-127, 127]) as xquad reads them: int8.
inline void vstore_xq(int8_t* p, Vec v) {
  const IVec i = _mm256_cvtps_epi32(v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}
