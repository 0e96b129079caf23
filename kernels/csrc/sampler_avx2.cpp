// The kernels of sampler_kernels.h built for AVX2 with FMA. Only this file compiles them for
// AVX2, and it includes no torch header (see avx2_kernels.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_kernels.h"
#include "sampler_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace skiff_cpu::sampler_avx2 {
#include "simd_avx2.h"
#include "simd_exp.h"

inline Mask no_lanes() { return _mm256_setzero_ps(); }
inline Mask lanes_or(Mask a, Mask b) { return _mm256_or_ps(a, b); }
inline bool any_lane(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline Mask nan_lanes(Vec v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
inline Mask banned_lanes(const bool* p) {  // W bools (0 or 1) -> their lanes
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, _mm256_setzero_si256()));
}
inline Vec ban(Vec v, Mask banned) {  // -inf in the banned lanes
  return _mm256_blendv_ps(v, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), banned);
}
inline Vec zero_below(Vec v, Vec x, Vec lo) {  // 0 where x < lo (NaN lanes kept)
  return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_NLT_UQ), v);
}
inline void vstream(float* p, Vec v) { _mm256_stream_ps(p, v); }  // p aligned; past the cache

#include "sampler_bodies.h"
}  // namespace skiff_cpu::sampler_avx2

#pragma GCC pop_options
