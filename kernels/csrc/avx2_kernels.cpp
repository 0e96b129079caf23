// The kernels of cpu_kernels.h built for AVX2 with FMA (x86-64 CPUs since 2013 without
// AVX-512), its Q8_0 x Q8_0 kernel (q8_bodies.h), which AVX-512 CPUs without VNNI run too, and
// its bf16 x bf16 kernel (simd_bf16_split.h, bf16_bodies.h).
// Only this file is compiled for AVX2, and it includes no torch header.
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
#pragma GCC target("avx2,fma")

namespace skiff_cpu::avx2 {
#include "simd_avx2.h"
#include "simd_exp.h"
#include "kernel_bodies.h"
#include "simd_bf16_split.h"
#include "bf16_bodies.h"
#include "q8_bodies.h"
}  // namespace skiff_cpu::avx2

#pragma GCC pop_options
