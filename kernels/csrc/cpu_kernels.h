// Raw-pointer fp32 kernels of the CPU worker, called by the ops in cpu_ops.cpp through
// `kernels()`: one body (kernel_bodies.h) built once per instruction set, AVX-512F
// (avx512_kernels.cpp) and AVX2 with FMA (avx2_kernels.cpp), picked for this CPU at run time;
// the Q8_0 x Q8_0 kernel (q8_bodies.h) for AVX2 and for AVX512-VNNI (vnni_kernels.cpp); the
// bf16 x bf16 kernel (bf16_bodies.h) for AVX2, AVX-512F and AVX512-BF16 (bf16_kernels.cpp).
#pragma once

#include <cstdint>

namespace skiff_cpu {

// How a weight matrix [N, K] is stored: fp32; bf16 (the upper half of an fp32); int8 with an
// fp32 scale per group of kInt8Group consecutive weights of a row (scale [N, K / kInt8Group],
// weight = int8 * scale). Products and sums are fp32 in all three.
enum class WeightFormat { kFloat32, kBFloat16, kInt8 };
constexpr int64_t kInt8Group = 32;

// y[m, n] = dot(x[m, :], w[n, :]) (w dequantized for int8) for m < M and n in
// [n_begin, n_end), with weight rows in blocks of `kLinearRowBlock` from n_begin (the caller
// splits N by whole blocks; a ragged end is finished row by row). x [M, K], w [N, K],
// y [M, N] row-major; K % 16 == 0 (% kInt8Group for int8).
constexpr int64_t kLinearRowBlock = 4;
using LinearRows = void (*)(const float* x, const void* w, WeightFormat format,
                            const float* scale, float* y, int64_t M, int64_t K, int64_t N,
                            int64_t n_begin, int64_t n_end);

// The panel kernel's weights: [ceil(N / kPanel), K, kPanel], panel p holding output features
// [p kPanel, (p + 1) kPanel) side by side for each k (zero past N), in any WeightFormat; int8
// scales likewise [ceil(N / kPanel), K / kInt8Group, kPanel]. Each output y[m, n] is one fma
// chain over k in order (acc = x[m, k] * w[n, k] + acc, from 0, w dequantized first), whatever
// the register tile: its bits do not depend on M, the row's place, the tile or the
// instruction set. Computes outputs of panels [p_begin, p_end) for m < M; x [M, K],
// y [M, N] row-major.
constexpr int64_t kPanel = 16;
using LinearPanels = void (*)(const float* x, const void* packed, WeightFormat format,
                              const float* scale, float* y, int64_t M, int64_t K, int64_t N,
                              int64_t p_begin, int64_t p_end);

// Q8_0 x Q8_0 (W8A8, like llama.cpp's Q8_0 dot product): y[m, n] for m < M and panels
// [p_begin, p_end) from int8 weights packed for 4-byte dot products, [ceil(N / kPanel),
// K / 4, kPanel, 4] (panel p, k-quad j, lane c: weights w[p kPanel + c, 4 j .. 4 j + 3]; zero
// past N, |w| <= 127) with their group scales [ceil(N / kPanel), K / kInt8Group, kPanel], and
// x quantized per row and group of kInt8Group by the same table's quantize (xq [M, K],
// |q| <= 127; x_scale [M, K / kInt8Group]). Each group's dot product is an exact int32 sum
// (|sum| <= 32 127^2 < 2^24, so exact in fp32 too); each output is one fp32 chain over the
// groups in order:
// acc = float(dot_g) * (w_scale_g * x_scale_g) + acc (one fma, from 0). Its bits do not
// depend on M, the row's place, the tile or the instruction set. K % kInt8Group == 0.
using LinearQ8Panels = void (*)(const int8_t* xq, const float* x_scale, const int8_t* packed,
                                const float* scale, float* y, int64_t M, int64_t K, int64_t N,
                                int64_t p_begin, int64_t p_end);
constexpr int64_t kQ8Quad = 4;  // consecutive k of a lane in a 32-bit dot product

// x [groups, kInt8Group] (rows of x one after the other) -> xq [groups, kInt8Group] and
// x_scale [groups]: scale = max |x| / 127, q = x / scale rounded half to even (0 where the
// scale is 0), as llama.cpp's Q8_0 but with a division. IEEE fp32 operations only: the same
// q and scales in every instruction set; xq holds q as its table's linear_panels reads it
// (int8 for AVX2, q + 128 as unsigned bytes for VNNI).
using QuantizeQ8 = void (*)(const float* x, int8_t* xq, float* x_scale, int64_t groups);

struct Q8Kernels {
  QuantizeQ8 quantize;
  LinearQ8Panels linear_panels;
};

// bf16 x bf16 (W16A16, like llama.cpp's BF16 dot product): y[m, n] for m < M and panels
// [p_begin, p_end) from bf16 weights packed in pairs, [ceil(N / kPanel), K / 2, kPanel, 2]
// (panel p, pair j, lane c: w[p kPanel + c, 2 j] and w[p kPanel + c, 2 j + 1]; zero past N;
// none below fp32's normal range), and x rounded to bf16 by the same table's round (xb [M, K]).
// Each output is one fp32 chain over the pairs in order, as AVX512-BF16's vdpbf16ps computes
// it: acc = x[2 j + 1] w[2 j + 1] + acc, then acc = x[2 j] w[2 j] + acc (each product exact
// in fp32, each sum rounded to nearest even, a sum below fp32's normal range flushed to zero),
// from 0. Its bits do not depend on M, the row's place, the tile or the instruction set.
// K % 2 == 0.
using LinearBf16Panels = void (*)(const uint16_t* xb, const uint16_t* packed, float* y,
                                  int64_t M, int64_t K, int64_t N, int64_t p_begin,
                                  int64_t p_end);
constexpr int64_t kBf16Pair = 2;  // consecutive k of a lane in one bf16 dot product

// x [n] -> xb [n] in bf16: rounded to nearest even; values below fp32's normal range to zero
// (sign kept), NaN to a quiet NaN; as vcvtneps2bf16, in integer operations (the same bits in
// every instruction set).
using RoundBf16 = void (*)(const float* x, uint16_t* xb, int64_t n);

struct Bf16Kernels {
  RoundBf16 round;
  LinearBf16Panels linear_panels;
};

// out = rms_norm(x) * weight over `dim` floats (variance in fp32, like the model).
using RmsNormRow = void (*)(const float* x, const float* weight, float* out, int64_t dim,
                            float eps);

// Neox rotary in place on one head: the first `rot_dim` dims rotate by cos_sin =
// [cos (rot_dim / 2), sin (rot_dim / 2)], the rest pass through.
using RotateHead = void (*)(float* head, const float* cos_sin, int64_t rot_dim);

// The `group` query heads that share KV head `kv_head` (q: [group, head_dim], contiguous),
// for one token whose causal context is positions [0, context_len) of its request:
// out[h] = softmax(scale * q[h] . K[t]) @ V[t] over t < context_len. Position t lies in slot
// block_table[t / block_size] * block_size + t % block_size; head `kv_head` of a slot starts
// at (slot * num_kv_heads + kv_head) * head_dim. `scores` holds group * context_len floats;
// head_dim % 16 == 0. `out` is [group, head_dim] with a row stride of `out_stride` floats.
using Attend = void (*)(const float* q, int64_t group, const float* key_cache,
                        const float* value_cache, const int32_t* block_table,
                        int64_t context_len, int64_t block_size, int64_t num_kv_heads,
                        int64_t kv_head, int64_t head_dim, float scale, float* scores,
                        float* out, int64_t out_stride);

// Prefill attention, flash-attention style: `tokens` consecutive query tokens of one request,
// at positions first_pos .. first_pos + tokens - 1 (token j sees context positions
// [0, first_pos + j]), times the `group` query heads of KV head `kv_head`: at most
// kPrefillRows rows. q: token j's heads at q + j * q_stride ([group, head_dim]); out likewise
// with out_stride. The rows are held transposed (a vector holds 16 rows), the keys are walked
// in tiles of kKeyTile positions, each key and value read once for all rows: scores, then the
// running max and sum (online softmax), then the rescaled sum of the values. Key tiles past
// the last row's position are never read; a tile past the first row's is masked. Cache layout
// as in `attend`; `scratch` holds prefill_scratch_floats(head_dim) floats; head_dim % 16 == 0.
constexpr int64_t kPrefillRows = 64;
constexpr int64_t kKeyTile = 64;
constexpr int64_t prefill_scratch_floats(int64_t head_dim) {
  return (2 * head_dim + kKeyTile) * kPrefillRows;
}
using AttendPrefill = void (*)(const float* q, int64_t q_stride, int64_t tokens, int64_t group,
                               int64_t first_pos, const float* key_cache,
                               const float* value_cache, const int32_t* block_table,
                               int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                               int64_t head_dim, float scale, float* scratch, float* out,
                               int64_t out_stride);

// out[i] = silu(gate_up[i]) * gate_up[dim + i] for i < dim.
using SiluAndMulRow = void (*)(const float* gate_up, float* out, int64_t dim);

struct KernelTable {
  LinearRows linear_rows;
  LinearPanels linear_panels;
  RmsNormRow rms_norm_row;
  RotateHead rotate_head;
  Attend attend;
  AttendPrefill attend_prefill;
  SiluAndMulRow silu_and_mul_row;
};

namespace avx512 {
extern const KernelTable kernel_table;
extern const Bf16Kernels bf16_kernels;  // pairs widened to fp32, two fma
}
namespace avx2 {
extern const KernelTable kernel_table;
extern const Q8Kernels q8_kernels;  // vpmaddubsw + vpmaddwd
extern const Bf16Kernels bf16_kernels;  // pairs widened to fp32, two fma
}
namespace avx512_vnni {
extern const Q8Kernels q8_kernels;  // vpdpbusd
}
namespace avx512_bf16 {
extern const Bf16Kernels bf16_kernels;  // vdpbf16ps
}

// The instruction set the kernels use: "avx512" or "avx2", the widest this CPU has unless
// `use_isa` picked another; "" where the CPU has neither (then `kernels()` must not be called).
const char* isa();

// Run the kernels of `name` from now on; false (and nothing changes) if this CPU lacks it.
bool use_isa(const char* name);

// The kernels of `isa()`.
const KernelTable& kernels();

// The int8 dot products of the Q8_0 x Q8_0 kernel: "avx512_vnni" where isa() is "avx512" and
// the CPU has AVX512-VNNI and AVX512-BW, else "avx2" (every AVX-512 CPU has AVX2); "" with
// neither. Both compute the same int32 sums, hence the same bits.
const char* int8_dot_isa();

// The Q8_0 x Q8_0 kernels of `int8_dot_isa()`.
const Q8Kernels& q8_kernels();

// The bf16 dot products of the bf16 x bf16 kernel: "avx512_bf16" (vdpbf16ps) where isa() is
// "avx512" and the CPU has AVX512-BF16 and AVX512-BW, else isa() itself (pairs widened to
// fp32); "" with neither. `use_bf16_dot_isa` picks a narrower one that isa() allows (tests and
// benchmarks run each). All compute the same bits.
const char* bf16_dot_isa();
bool use_bf16_dot_isa(const char* name);

// The bf16 x bf16 kernels of `bf16_dot_isa()`.
const Bf16Kernels& bf16_kernels();

}  // namespace skiff_cpu
