// The kernels of sampler_kernels.h built for AVX-512F. Only this file compiles them for
// AVX-512, and it includes no torch header (see avx512_kernels.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_kernels.h"
#include "sampler_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace skiff_cpu::sampler_avx512 {
#include "simd_avx512.h"
#include "simd_exp.h"

inline Mask no_lanes() { return 0; }
inline Mask lanes_or(Mask a, Mask b) { return a | b; }
inline bool any_lane(Mask m) { return m != 0; }
inline Mask nan_lanes(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline Mask banned_lanes(const bool* p) {  // W bools (0 or 1) -> their lanes
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_test_epi32_mask(b, b);
}
inline Vec ban(Vec v, Mask banned) {  // -inf in the banned lanes
  return _mm512_mask_mov_ps(v, banned, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}
inline Vec zero_below(Vec v, Vec x, Vec lo) {  // 0 where x < lo (NaN lanes kept)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), v);
}
inline float vmax_all(Vec v) { return _mm512_reduce_max_ps(v); }
inline void vstream(float* p, Vec v) { _mm512_stream_ps(p, v); }  // p aligned; past the cache

#include "sampler_bodies.h"
}  // namespace skiff_cpu::sampler_avx512

#pragma GCC pop_options
