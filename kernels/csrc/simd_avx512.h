// The vector vocabulary of kernel_bodies.h for AVX-512F: 16 floats per vector, 32 registers.
// Included by avx512_kernels.cpp only, inside its namespace and target region.
using Vec = __m512;
using IVec = __m512i;
using Mask = __mmask16;  // lanes that take part
constexpr int64_t W = 16;
constexpr int kTokensPerTile = 4;  // rows of x per linear register tile
constexpr int kAccumulators = 16;  // vector accumulators a prefill tile may hold
constexpr int kVecRegisters = 32;
constexpr int kPanelRows = 8;      // rows of x per panel tile: 8 x 3 accumulators

inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline Vec vfnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); } // c - a * b
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vround(Vec v) {
  return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec vscale2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

// W bf16 (fp32's top half) or int8 values as fp32.
inline Vec vload_bf16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline Vec vload_int8(const int8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}

// A vector of W bf16 pairs (2 W values, lane i: values 2 i and 2 i + 1) as the fp32 of the
// even and of the odd values: a shift, a mask.
inline Vec vbf16_even(Vec pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(pairs), 16));
}
inline Vec vbf16_odd(Vec pairs) {
  const auto high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(pairs), high));
}

// Weights k..k+W-1 of a row as fp32 (`scale`: the row's int8 group scales).
inline Vec vload_weights(const float* row, int64_t k, const float*) { return vload(row + k); }
inline Vec vload_weights(const uint16_t* row, int64_t k, const float*) { return vload_bf16(row + k); }
inline Vec vload_weights(const int8_t* row, int64_t k, const float* scale) {
  return vmul(vload_int8(row + k), vset1(scale[k / kInt8Group]));
}

inline IVec vload_int(const int32_t* p) { return _mm512_loadu_si512(p); }
inline Mask mask_all() { return static_cast<Mask>(0xffff); }
inline Mask mask_le(int32_t key, IVec pos) {  // lanes with key <= pos
  return _mm512_cmple_epi32_mask(_mm512_set1_epi32(key), pos);
}
inline Vec mask_max(Vec a, Mask m, Vec b) { return _mm512_mask_max_ps(a, m, a, b); }
inline Vec zero_unless(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }
