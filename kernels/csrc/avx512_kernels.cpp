// The kernels of cpu_kernels.h built for AVX-512F, and its bf16 x bf16 kernel without
// AVX512-BF16 (simd_bf16_split.h). It includes no torch header: no inline torch code built
// for AVX-512 can end up on a CPU without it.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace skiff_cpu::avx512 {
#include "simd_avx512.h"
#include "simd_exp.h"
#include "kernel_bodies.h"
#include "simd_bf16_split.h"
#include "bf16_bodies.h"
}  // namespace skiff_cpu::avx512

#pragma GCC pop_options
