// AVX-512 bodies of cpu_kernels.h. Only this file is compiled for AVX-512, and it includes
// no torch header: no inline torch code built for AVX-512 can end up on a CPU without it.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "cpu_kernels.h"

namespace skiff_cpu {

bool avx512_supported() { return __builtin_cpu_supports("avx512f"); }

#pragma GCC push_options
#pragma GCC target("avx512f,fma")

namespace {

constexpr int kTokensPerTile = 4;         // rows of x per register tile
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead in each weight row

// Weights k..k+15 of a row as fp32 (`scale`: the row's int8 group scales).
inline __m512 load16(const float* row, int64_t k, const float*) {
  return _mm512_loadu_ps(row + k);
}
inline __m512 load16(const uint16_t* row, int64_t k, const float*) {  // bf16: fp32's top half
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const int8_t* row, int64_t k, const float* scale) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
                       _mm512_set1_ps(scale[k / kInt8Group]));
}

// y[m, n + r] = dot(x[m, :], w[n + r, :]) for m < M, r < R. Each 16-weight slice of R weight
// rows is loaded (and dequantized) once and multiplied into all M rows of x.
template <int M, int R, bool Prefetch, typename T>
inline void tile(const float* x, const T* w, const float* scale, float* y, int64_t K, int64_t N,
                 int64_t n) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      const T* row = w + (n + r) * K;
      if constexpr (Prefetch)
        _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = load16(row, k, scale + (n + r) * (K / kInt8Group));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// All M rows of x against weight rows [n, n + R).
template <int R, bool Prefetch, typename T>
void weight_block(const float* x, const T* w, const float* scale, float* y, int64_t M,
                  int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + kTokensPerTile <= M; m += kTokensPerTile)
    tile<kTokensPerTile, R, Prefetch>(x + m * K, w, scale, y + m * N, K, N, n);
  switch (M - m) {
    case 1: tile<1, R, Prefetch>(x + m * K, w, scale, y + m * N, K, N, n); break;
    case 2: tile<2, R, Prefetch>(x + m * K, w, scale, y + m * N, K, N, n); break;
    case 3: tile<3, R, Prefetch>(x + m * K, w, scale, y + m * N, K, N, n); break;
    default: break;
  }
}

template <typename T>
void rows_of(const float* x, const T* w, const float* scale, float* y, int64_t M, int64_t K,
             int64_t N, int64_t n_begin, int64_t n_end) {
  // A single token row gains nothing from software prefetch (the hardware's suffices).
  const bool prefetch = M > 1;
  int64_t n = n_begin;
  for (; n + kLinearRowBlock <= n_end; n += kLinearRowBlock) {
    if (prefetch)
      weight_block<kLinearRowBlock, true>(x, w, scale, y, M, K, N, n);
    else
      weight_block<kLinearRowBlock, false>(x, w, scale, y, M, K, N, n);
  }
  for (; n < n_end; ++n) weight_block<1, false>(x, w, scale, y, M, K, N, n);
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// e^x, 16 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
// (relative error ~1e-8, below fp32 rounding), times 2^n by scalef. x is clamped to
// [-87, 88]: e^-87 ~ 1.6e-38 is still a normal fp32, e^88 ~ 1.7e38 still finite.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);   // ln2, the rest
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// s[t] = e^(s[t] - shift) in place; returns their sum.
float exp_shifted(float* s, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), sh));
    _mm512_storeu_ps(s + t, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (t < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), sh));
    _mm512_mask_storeu_ps(s + t, tail, e);
    acc = _mm512_mask_add_ps(acc, tail, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

// Where head `kv_head` of context position t starts in a [num_slots, kv_heads, head_dim] cache.
inline int64_t head_offset(const int32_t* block_table, int64_t t, int64_t block_size,
                           int64_t num_kv_heads, int64_t kv_head, int64_t head_dim) {
  const int64_t slot = static_cast<int64_t>(block_table[t / block_size]) * block_size +
                       t % block_size;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

// out[0 : 16 C] = sum over t < context_len of p[t] * V[t] for one KV head, in registers.
template <int C>
void weighted_sum(const float* p, const float* value_cache, const int32_t* block_table,
                  int64_t context_len, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                  float* out) {
  constexpr int64_t head_dim = 16 * C;
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < context_len; ++t) {
    const float* v =
        value_cache + head_offset(block_table, t, block_size, num_kv_heads, kv_head, head_dim);
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

// Prefill attention (attend_prefill) holds its R = 16 V query rows transposed, [d, R]: a
// vector is one dim of 16 rows, so keys and values are broadcast one float at a time straight
// from the cache and nothing of them is copied or transposed.

// st[j, :] = keys[j] . qt for j < NR: the scores of NR keys against all R rows.
template <int NR, int V>
inline void score_keys(const float* const* keys, const float* qt, int64_t head_dim, float* st) {
  constexpr int64_t R = 16 * V;
  __m512 acc[NR][V];
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 qv[V];
    for (int v = 0; v < V; ++v) qv[v] = _mm512_loadu_ps(qt + d * R + 16 * v);
    for (int j = 0; j < NR; ++j) {
      const __m512 k = _mm512_set1_ps(keys[j][d]);
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(k, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(st + j * R + 16 * v, acc[j][v]);
}

// ot[d, :] = ot[d, :] * alpha + sum over j < nk of values[j][d] * pt[j, :], d in [d0, d0 + DR).
// The tile's sum is formed on its own first: small terms are not added one by one to a large
// running total (fp32 would lose them).
template <int DR, int V>
inline void accumulate_values(const float* const* values, int64_t nk, const float* pt,
                              const __m512* alpha, float* ot, int64_t d0) {
  constexpr int64_t R = 16 * V;
  __m512 acc[DR][V];
  for (int r = 0; r < DR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    __m512 pv[V];
    for (int v = 0; v < V; ++v) pv[v] = _mm512_loadu_ps(pt + j * R + 16 * v);
    const float* value = values[j] + d0;
    for (int r = 0; r < DR; ++r) {
      const __m512 x = _mm512_set1_ps(value[r]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(x, pv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < DR; ++r)
    for (int v = 0; v < V; ++v) {
      float* o = ot + (d0 + r) * R + 16 * v;
      _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), alpha[v], acc[r][v]));
    }
}

template <int V>
void prefill_rows(const float* q, int64_t q_stride, int64_t tokens, int64_t group,
                  int64_t first_pos, const float* key_cache, const float* value_cache,
                  const int32_t* block_table, int64_t block_size, int64_t num_kv_heads,
                  int64_t kv_head, int64_t head_dim, float scale, float* scratch, float* out,
                  int64_t out_stride) {
  constexpr int64_t R = 16 * V;
  constexpr int NR = V >= 3 ? 4 : 8;  // keys per score tile: NR x V accumulators
  constexpr int DR = V >= 3 ? 4 : 8;  // dims per value tile
  const int64_t rows = tokens * group;  // row m: token m / group, head m % group
  float* qt = scratch;                  // [head_dim, R] queries * scale
  float* ot = qt + head_dim * R;        // [head_dim, R] output, unnormalized
  float* st = ot + head_dim * R;        // [kKeyTile, R] scores, then their exponentials
  alignas(64) int32_t pos[R];           // each row's position; padding rows repeat the last
  for (int64_t m = 0; m < R; ++m) {
    const int64_t row = std::min(m, rows - 1);
    const float* src = q + (row / group) * q_stride + (row % group) * head_dim;
    pos[m] = static_cast<int32_t>(first_pos + row / group);
    for (int64_t d = 0; d < head_dim; ++d) qt[d * R + m] = m < rows ? src[d] * scale : 0.0f;
  }
  std::fill(ot, ot + head_dim * R, 0.0f);
  __m512i posv[V];
  __m512 run_max[V], run_sum[V];
  for (int v = 0; v < V; ++v) {
    posv[v] = _mm512_load_si512(pos + 16 * v);
    run_max[v] = _mm512_set1_ps(-INFINITY);
    run_sum[v] = _mm512_setzero_ps();
  }
  const float* keys[kKeyTile];
  const float* values[kKeyTile];
  const int64_t kv_len = first_pos + tokens;  // the last row sees them all
  for (int64_t n0 = 0; n0 < kv_len; n0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, kv_len - n0);
    const int64_t padded = (nk + NR - 1) / NR * NR;  // keys past kv_len repeat the last, masked
    for (int64_t j = 0; j < padded; ++j) {
      const int64_t offset = head_offset(block_table, std::min(n0 + j, kv_len - 1), block_size,
                                         num_kv_heads, kv_head, head_dim);
      keys[j] = key_cache + offset;
      values[j] = value_cache + offset;
    }
    for (int64_t j = 0; j < padded; j += NR) score_keys<NR, V>(keys + j, qt, head_dim, st + j * R);
    const bool causal = n0 + padded - 1 > first_pos;  // some key lies past the first row
    auto visible = [&](int64_t j, int v) {  // rows of vector v that see key n0 + j
      const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(n0 + j));
      return causal ? _mm512_cmple_epi32_mask(key, posv[v]) : static_cast<__mmask16>(0xffff);
    };
    __m512 tile_max[V];
    for (int v = 0; v < V; ++v) tile_max[v] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; ++j)
      for (int v = 0; v < V; ++v)
        tile_max[v] = _mm512_mask_max_ps(tile_max[v], visible(j, v), tile_max[v],
                                         _mm512_loadu_ps(st + j * R + 16 * v));
    __m512 alpha[V];  // e^(old max - new max): rescales the sum and output so far
    for (int v = 0; v < V; ++v) {
      const __m512 new_max = _mm512_max_ps(run_max[v], tile_max[v]);
      alpha[v] = exp16(_mm512_sub_ps(run_max[v], new_max));  // first tile: e^-87 * 0
      run_max[v] = new_max;
    }
    __m512 tile_sum[V];  // summed on its own, like the values
    for (int v = 0; v < V; ++v) tile_sum[v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; ++j)
      for (int v = 0; v < V; ++v) {
        float* s = st + j * R + 16 * v;
        const __m512 p = _mm512_maskz_mov_ps(
            visible(j, v), exp16(_mm512_sub_ps(_mm512_loadu_ps(s), run_max[v])));
        _mm512_storeu_ps(s, p);
        tile_sum[v] = _mm512_add_ps(tile_sum[v], p);
      }
    for (int v = 0; v < V; ++v) run_sum[v] = _mm512_fmadd_ps(run_sum[v], alpha[v], tile_sum[v]);
    for (int64_t d0 = 0; d0 < head_dim; d0 += DR)
      accumulate_values<DR, V>(values, nk, st, alpha, ot, d0);
  }
  alignas(64) float inv[R];
  for (int v = 0; v < V; ++v)
    _mm512_store_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.0f), run_sum[v]));
  for (int64_t m = 0; m < rows; ++m) {
    float* dst = out + (m / group) * out_stride + (m % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = ot[d * R + m] * inv[m];
  }
}

}  // namespace

void attend_prefill(const float* q, int64_t q_stride, int64_t tokens, int64_t group,
                    int64_t first_pos, const float* key_cache, const float* value_cache,
                    const int32_t* block_table, int64_t block_size, int64_t num_kv_heads,
                    int64_t kv_head, int64_t head_dim, float scale, float* scratch, float* out,
                    int64_t out_stride) {
  static constexpr decltype(&prefill_rows<1>) by_vectors[] = {prefill_rows<1>, prefill_rows<2>,
                                                             prefill_rows<3>, prefill_rows<4>};
  static_assert(kPrefillRows == 16 * 4, "one variant per number of row vectors");
  by_vectors[(tokens * group + 15) / 16 - 1](q, q_stride, tokens, group, first_pos, key_cache,
                                             value_cache, block_table, block_size, num_kv_heads,
                                             kv_head, head_dim, scale, scratch, out, out_stride);
}

void linear_rows(const float* x, const void* w, WeightFormat format, const float* scale,
                 float* y, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  switch (format) {
    case WeightFormat::kFloat32:
      rows_of(x, static_cast<const float*>(w), nullptr, y, M, K, N, n_begin, n_end);
      break;
    case WeightFormat::kBFloat16:
      rows_of(x, static_cast<const uint16_t*>(w), nullptr, y, M, K, N, n_begin, n_end);
      break;
    case WeightFormat::kInt8:
      rows_of(x, static_cast<const int8_t*>(w), scale, y, M, K, N, n_begin, n_end);
      break;
  }
}

void rms_norm_row(const float* x, const float* weight, float* out, int64_t dim, float eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, dim) / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = x[i] * inv * weight[i];
}

void rotate_head(float* head, const float* cos_sin, int64_t rot_dim) {
  const int64_t half = rot_dim / 2;
  const float* cos = cos_sin;
  const float* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = head[i], x2 = head[half + i];
    head[i] = x1 * cos[i] - x2 * sin[i];
    head[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

void attend(const float* q, int64_t group, const float* key_cache, const float* value_cache,
            const int32_t* block_table, int64_t context_len, int64_t block_size,
            int64_t num_kv_heads, int64_t kv_head, int64_t head_dim, float scale,
            float* scores, float* out, int64_t out_stride) {
  auto offset = [&](int64_t t) {
    return head_offset(block_table, t, block_size, num_kv_heads, kv_head, head_dim);
  };
  // Scores: each key is read once for all query heads of its group.
  for (int64_t t = 0; t < context_len; ++t) {
    const float* k = key_cache + offset(t);
    for (int64_t h = 0; h < group; ++h)
      scores[h * context_len + t] = dot(q + h * head_dim, k, head_dim) * scale;
  }
  // Softmax per head, then the weighted sum of the values (each value read once).
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores + h * context_len;
    float max_score = -INFINITY;
    for (int64_t t = 0; t < context_len; ++t) max_score = std::max(max_score, s[t]);
    const float total = exp_shifted(s, context_len, max_score);
    const __m512 inv = _mm512_set1_ps(1.0f / total);
    int64_t t = 0;
    for (; t + 16 <= context_len; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    for (; t < context_len; ++t) s[t] /= total;
  }
  for (int64_t h = 0; h < group; ++h) {
    const float* p = scores + h * context_len;
    float* o = out + h * out_stride;
    switch (head_dim / 16) {
      case 1: weighted_sum<1>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 2: weighted_sum<2>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 3: weighted_sum<3>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 4: weighted_sum<4>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 5: weighted_sum<5>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 6: weighted_sum<6>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 7: weighted_sum<7>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 8: weighted_sum<8>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      default: {  // head_dim > 128: accumulate in `o` itself
        for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(o + d, _mm512_setzero_ps());
        for (int64_t t = 0; t < context_len; ++t) {
          const float* v = value_cache + offset(t);
          const __m512 pt = _mm512_set1_ps(p[t]);
          for (int64_t d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + d), _mm512_loadu_ps(o + d)));
        }
      }
    }
  }
}

void silu_and_mul_row(const float* gate_up, float* out, int64_t dim) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {  // silu(g) = g / (1 + e^-g)
    const __m512 g = _mm512_loadu_ps(gate_up + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(gate_up + dim + i)));
  }
  for (; i < dim; ++i) {
    const float g = gate_up[i];
    out[i] = g / (1.0f + std::exp(-g)) * gate_up[dim + i];
  }
}

#pragma GCC pop_options

}  // namespace skiff_cpu
