// The Q8_0 x Q8_0 kernel of cpu_kernels.h built for AVX512-VNNI (with AVX512-BW). Only this
// file is compiled for VNNI, and it includes no torch header; int8_dot_isa() runs it only on a
// CPU that has both.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "cpu_kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni,fma")

namespace skiff_cpu::avx512_vnni {
#include "simd_avx512.h"
#include "simd_avx512_vnni.h"
#include "q8_bodies.h"
}  // namespace skiff_cpu::avx512_vnni

#pragma GCC pop_options
