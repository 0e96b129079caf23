// The bf16 x bf16 kernel of cpu_kernels.h built for AVX512-BF16 (with AVX512-BW). Only this
// file is compiled for AVX512-BF16, and it includes no torch header; bf16_dot_isa() runs it
// only on a CPU that has both.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "cpu_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,fma")

namespace skiff_cpu::avx512_bf16 {
#include "simd_avx512.h"
#include "simd_avx512_bf16.h"
#include "bf16_bodies.h"
}  // namespace skiff_cpu::avx512_bf16

#pragma GCC pop_options
