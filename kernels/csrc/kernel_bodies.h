// The bodies of cpu_kernels.h, written once over a vector vocabulary (simd_avx512.h,
// simd_avx2.h: `Vec` of `W` floats, vload, vfmadd, masks, ...). Each <isa>_kernels.cpp
// includes its vocabulary and then this file inside its own namespace and target region, and
// fills its KernelTable at the end. No include guard: included once per instruction set.

#include "tile_store.h"

namespace {

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead in each weight row

// y[m, n + r] = dot(x[m, :], w[n + r, :]) for m < M, r < R. Each W-weight slice of R weight
// rows is loaded (and dequantized) once and multiplied into all M rows of x.
template <int M, int R, bool Prefetch, typename T>
inline void tile(const float* x, const T* w, const float* scale, float* y, int64_t K, int64_t N,
                 int64_t n) {
  Vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  for (int64_t k = 0; k < K; k += W) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) {
      const T* row = w + (n + r) * K;
      if constexpr (Prefetch)
        _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T0);
      wv[r] = vload_weights(row, k, scale + (n + r) * (K / kInt8Group));
    }
    for (int m = 0; m < M; ++m) {
      const Vec xv = vload(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = vfmadd(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = vsum(acc[m][r]);
}

// All M rows of x against weight rows [n, n + R): tiles of kTokensPerTile rows, then the rest.
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

// The panel kernel (linear_panels): a register tile of MR rows of x by NP panels holds
// MR x NP kPanel accumulators; each step over k loads the panels' kPanel weights once and
// broadcasts x[m, k] into them. No horizontal sums: each output's chain lies in one lane.
constexpr int kPanelVecs = static_cast<int>(kPanel / W);  // vectors across a panel
static_assert(kPanel % W == 0, "a panel is whole vectors");
constexpr int64_t kPanelDepth = 256;            // k per block: a panel's block is 16 KB
constexpr int64_t kPanelChunkBytes = 192 << 10;  // panel blocks kept in L2 while rows pass
constexpr int64_t kPanelChunk = kPanelChunkBytes / (kPanelDepth * kPanel * sizeof(float));

// Panels side by side in a tile of `rows` rows: as many as the registers hold (accumulators,
// the weights of one k, one broadcast), at most 4.
constexpr int panels_per_tile(int rows) {
  const int n = (kVecRegisters - 1) / ((rows + 1) * kPanelVecs);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

// Rows of x below which bf16 and int8 panels are dequantized in the register tile itself
// rather than once per k-block into fp32 for all the rows (see panels_of).
constexpr int64_t kDequantizeRows = 3;

// W weights of panel row k (from w) as fp32: bf16 widened; int8 times the W lanes' group
// scales (scale: the panel's [K / kInt8Group, kPanel] scales, from lane v W).
inline Vec panel_weights(const float* w, const float*, int64_t) { return vload(w); }
inline Vec panel_weights(const uint16_t* w, const float*, int64_t) { return vload_bf16(w); }
inline Vec panel_weights(const int8_t* w, const float* scale, int64_t k) {
  return vmul(vload_int8(w), vload(scale + k / kInt8Group * kPanel));
}

// y[m, n0 + c] for m < MR, c < NP kPanel (clipped at N), over k in [k0, k1): from 0 when
// k0 == 0, else continuing the chains stored in y (an fp32 store and load are exact).
// x: row m at x + m K; w: panel rows k0 .. k1 - 1, panel p's at w + p stride; int8: panel
// p's scales at scale + p scale_stride.
template <int MR, int NP, typename T>
inline void panel_tile(const float* x, const T* w, int64_t stride, const float* scale,
                       int64_t scale_stride, float* y, int64_t K, int64_t N, int64_t n0,
                       int64_t k0, int64_t k1) {
  constexpr int V = NP * kPanelVecs;
  const int64_t cols = std::min<int64_t>(NP * kPanel, N - n0);
  alignas(64) float row[V * W];
  Vec acc[MR][V];
  for (int m = 0; m < MR; ++m) {
    if (k0 == 0) {
      for (int j = 0; j < V; ++j) acc[m][j] = vzero();
    } else if (cols == NP * kPanel) {
      for (int j = 0; j < V; ++j) acc[m][j] = vload(y + m * N + n0 + j * W);
    } else {
      std::fill(row, row + V * W, 0.0f);
      std::copy_n(y + m * N + n0, cols, row);
      for (int j = 0; j < V; ++j) acc[m][j] = vload(row + j * W);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    Vec wv[V];
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kPanelVecs; ++v) {
        const T* src = w + p * stride + (k - k0) * kPanel + v * W;
        if constexpr (std::is_same_v<T, int8_t>)
          wv[p * kPanelVecs + v] = panel_weights(src, scale + p * scale_stride + v * W, k);
        else
          wv[p * kPanelVecs + v] = panel_weights(src, nullptr, k);
      }
    for (int m = 0; m < MR; ++m) {
      const Vec xv = vset1(x[m * K + k]);
      for (int j = 0; j < V; ++j) acc[m][j] = vfmadd(xv, wv[j], acc[m][j]);
    }
  }
  store_tile(acc, y, N, n0, cols);
}

// Rows [0, MR) of x against panels [p_begin, p_end) over k in [k0, k1) (their rows from k0
// at w + (p - p_begin) stride, int8 scales at scale + (p - p_begin) scale_stride): tiles of
// panels_per_tile(MR) panels, then one at a time.
template <int MR, typename T>
void panel_rows(const float* x, const T* w, int64_t stride, const float* scale,
                int64_t scale_stride, float* y, int64_t K, int64_t N, int64_t p_begin,
                int64_t p_end, int64_t k0, int64_t k1) {
  constexpr int NP = panels_per_tile(MR);
  auto tile = [&](auto np, int64_t p) {
    const int64_t i = p - p_begin;
    const float* s = scale ? scale + i * scale_stride : nullptr;
    panel_tile<MR, decltype(np)::value>(x, w + i * stride, stride, s, scale_stride, y, K, N,
                                        p * kPanel, k0, k1);
  };
  int64_t p = p_begin;
  for (; p + NP <= p_end; p += NP) tile(std::integral_constant<int, NP>{}, p);
  for (; p < p_end; ++p) tile(std::integral_constant<int, 1>{}, p);
}

// panel_rows<1, T> .. panel_rows<kPanelRows, T>, by number of rows.
template <typename T, size_t... I>
constexpr auto panel_row_variants(std::index_sequence<I...>) {
  return std::array{&panel_rows<static_cast<int>(I) + 1, T>...};
}
template <typename T>
constexpr auto kPanelRowVariants =
    panel_row_variants<T>(std::make_index_sequence<static_cast<size_t>(kPanelRows)>{});

// Blocks of kPanelChunk panels (their k-blocks stay in L2); in each, k-blocks of kPanelDepth;
// in each, all rows of x in tiles of kPanelRows (then the rest) against the block's panels.
// From kDequantizeRows rows on, bf16 and int8 panels are first dequantized, a k-block of a
// panel block at a time, into fp32 (kPanelChunk kPanelDepth kPanel floats), once for all
// rows; the tiles compute the same fp32 weights from them as they would themselves, so the
// chains and their bits are the same either way.
template <typename T>
void panels_of(const float* x, const T* packed, const float* scale, float* y, int64_t M,
               int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  const bool dequantize = !std::is_same_v<T, float> && M >= kDequantizeRows;
  std::vector<float> scratch(dequantize ? kPanelChunk * kPanelDepth * kPanel : 0);
  const int64_t scale_stride = K / kInt8Group * kPanel;  // int8: one panel's scales
  for (int64_t p0 = p_begin; p0 < p_end; p0 += kPanelChunk) {
    const int64_t p1 = std::min(p_end, p0 + kPanelChunk);
    const float* s = scale ? scale + p0 * scale_stride : nullptr;
    for (int64_t k0 = 0; k0 < K; k0 += kPanelDepth) {
      const int64_t k1 = std::min(K, k0 + kPanelDepth);
      const T* w = packed + (p0 * K + k0) * kPanel;
      if (!dequantize) {
        for (int64_t m = 0; m < M; m += kPanelRows) {
          const int64_t rows = std::min<int64_t>(kPanelRows, M - m);
          kPanelRowVariants<T>[rows - 1](x + m * K, w, K * kPanel, s, scale_stride, y + m * N,
                                         K, N, p0, p1, k0, k1);
        }
        continue;
      }
      const int64_t stride = (k1 - k0) * kPanel;
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t k = k0; k < k1; ++k) {
          const T* src = packed + (p * K + k) * kPanel;
          float* dst = scratch.data() + (p - p0) * stride + (k - k0) * kPanel;
          for (int v = 0; v < kPanelVecs; ++v) {
            if constexpr (std::is_same_v<T, int8_t>)
              vstore(dst + v * W, panel_weights(src + v * W, s + (p - p0) * scale_stride + v * W, k));
            else
              vstore(dst + v * W, panel_weights(src + v * W, nullptr, k));
          }
        }
      for (int64_t m = 0; m < M; m += kPanelRows) {
        const int64_t rows = std::min<int64_t>(kPanelRows, M - m);
        kPanelRowVariants<float>[rows - 1](x + m * K, scratch.data(), stride, nullptr, 0,
                                           y + m * N, K, N, p0, p1, k0, k1);
      }
    }
  }
}

void linear_panels(const float* x, const void* packed, WeightFormat format, const float* scale,
                   float* y, int64_t M, int64_t K, int64_t N, int64_t p_begin, int64_t p_end) {
  switch (format) {
    case WeightFormat::kFloat32:
      panels_of(x, static_cast<const float*>(packed), nullptr, y, M, K, N, p_begin, p_end);
      break;
    case WeightFormat::kBFloat16:
      panels_of(x, static_cast<const uint16_t*>(packed), nullptr, y, M, K, N, p_begin, p_end);
      break;
    case WeightFormat::kInt8:
      panels_of(x, static_cast<const int8_t*>(packed), scale, y, M, K, N, p_begin, p_end);
      break;
  }
}

float dot(const float* a, const float* b, int64_t n) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = vfmadd(vload(a + i), vload(b + i), acc);
  float sum = vsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// e^x, W at a time (simd_exp.h), x clamped to [-87, 88]: e^-87 ~ 1.6e-38 is still a normal
// fp32, e^88 ~ 1.7e38 still finite.
inline Vec vexp(Vec x) { return exp_clamped(vmin(vmax(x, vset1(-87.0f)), vset1(88.0f))); }

// s[t] = e^(s[t] - shift) in place; returns their sum.
float exp_shifted(float* s, int64_t n, float shift) {
  const Vec sh = vset1(shift);
  Vec acc = vzero();
  int64_t t = 0;
  for (; t + W <= n; t += W) {
    const Vec e = vexp(vsub(vload(s + t), sh));
    vstore(s + t, e);
    acc = vadd(acc, e);
  }
  float sum = vsum(acc);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - shift);
    sum += s[t];
  }
  return sum;
}

// Where head `kv_head` of context position t starts in a [num_slots, kv_heads, head_dim] cache.
inline int64_t head_offset(const int32_t* block_table, int64_t t, int64_t block_size,
                           int64_t num_kv_heads, int64_t kv_head, int64_t head_dim) {
  const int64_t slot = static_cast<int64_t>(block_table[t / block_size]) * block_size +
                       t % block_size;
  return (slot * num_kv_heads + kv_head) * head_dim;
}

// out[0 : W C] = sum over t < context_len of p[t] * V[t] for one KV head, in registers.
template <int C>
void weighted_sum(const float* p, const float* value_cache, const int32_t* block_table,
                  int64_t context_len, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
                  float* out) {
  constexpr int64_t head_dim = W * C;
  Vec acc[C];
  for (int c = 0; c < C; ++c) acc[c] = vzero();
  for (int64_t t = 0; t < context_len; ++t) {
    const float* v =
        value_cache + head_offset(block_table, t, block_size, num_kv_heads, kv_head, head_dim);
    const Vec pt = vset1(p[t]);
    for (int c = 0; c < C; ++c) acc[c] = vfmadd(pt, vload(v + W * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) vstore(out + W * c, acc[c]);
}

// Prefill attention (attend_prefill) holds its R = W V query rows transposed, [d, R]: a
// vector is one dim of W rows, so keys and values are broadcast one float at a time straight
// from the cache and nothing of them is copied or transposed.

// Keys per score tile (and dims per value tile) next to V row vectors: a power of two (it
// divides kKeyTile and head_dim) of at most 8 whose tile fits the accumulator registers.
constexpr int tile_width(int V) {
  int n = 8;
  while (n > 1 && n * V > kAccumulators) n /= 2;
  return n;
}

// st[j, :] = keys[j] . qt for j < NR: the scores of NR keys against all R rows.
template <int NR, int V>
inline void score_keys(const float* const* keys, const float* qt, int64_t head_dim, float* st) {
  constexpr int64_t R = W * V;
  Vec acc[NR][V];
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = vzero();
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec qv[V];
    for (int v = 0; v < V; ++v) qv[v] = vload(qt + d * R + W * v);
    for (int j = 0; j < NR; ++j) {
      const Vec k = vset1(keys[j][d]);
      for (int v = 0; v < V; ++v) acc[j][v] = vfmadd(k, qv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int v = 0; v < V; ++v) vstore(st + j * R + W * v, acc[j][v]);
}

// ot[d, :] = ot[d, :] * alpha + sum over j < nk of values[j][d] * pt[j, :], d in [d0, d0 + DR).
// The tile's sum is formed on its own first: small terms are not added one by one to a large
// running total (fp32 would lose them).
template <int DR, int V>
inline void accumulate_values(const float* const* values, int64_t nk, const float* pt,
                              const Vec* alpha, float* ot, int64_t d0) {
  constexpr int64_t R = W * V;
  Vec acc[DR][V];
  for (int r = 0; r < DR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  for (int64_t j = 0; j < nk; ++j) {
    Vec pv[V];
    for (int v = 0; v < V; ++v) pv[v] = vload(pt + j * R + W * v);
    const float* value = values[j] + d0;
    for (int r = 0; r < DR; ++r) {
      const Vec x = vset1(value[r]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(x, pv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < DR; ++r)
    for (int v = 0; v < V; ++v) {
      float* o = ot + (d0 + r) * R + W * v;
      vstore(o, vfmadd(vload(o), alpha[v], acc[r][v]));
    }
}

template <int V>
void prefill_rows(const float* q, int64_t q_stride, int64_t tokens, int64_t group,
                  int64_t first_pos, const float* key_cache, const float* value_cache,
                  const int32_t* block_table, int64_t block_size, int64_t num_kv_heads,
                  int64_t kv_head, int64_t head_dim, float scale, float* scratch, float* out,
                  int64_t out_stride) {
  constexpr int64_t R = W * V;
  constexpr int NR = tile_width(V);     // keys per score tile: NR x V accumulators
  constexpr int DR = tile_width(V);     // dims per value tile
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
  IVec posv[V];
  Vec run_max[V], run_sum[V];
  for (int v = 0; v < V; ++v) {
    posv[v] = vload_int(pos + W * v);
    run_max[v] = vset1(-INFINITY);
    run_sum[v] = vzero();
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
      return causal ? mask_le(static_cast<int32_t>(n0 + j), posv[v]) : mask_all();
    };
    Vec tile_max[V];
    for (int v = 0; v < V; ++v) tile_max[v] = vset1(-INFINITY);
    for (int64_t j = 0; j < padded; ++j)
      for (int v = 0; v < V; ++v)
        tile_max[v] = mask_max(tile_max[v], visible(j, v), vload(st + j * R + W * v));
    Vec alpha[V];  // e^(old max - new max): rescales the sum and output so far
    for (int v = 0; v < V; ++v) {
      const Vec new_max = vmax(run_max[v], tile_max[v]);
      alpha[v] = vexp(vsub(run_max[v], new_max));  // first tile: e^-87 * 0
      run_max[v] = new_max;
    }
    Vec tile_sum[V];  // summed on its own, like the values
    for (int v = 0; v < V; ++v) tile_sum[v] = vzero();
    for (int64_t j = 0; j < padded; ++j)
      for (int v = 0; v < V; ++v) {
        float* s = st + j * R + W * v;
        const Vec p = zero_unless(visible(j, v), vexp(vsub(vload(s), run_max[v])));
        vstore(s, p);
        tile_sum[v] = vadd(tile_sum[v], p);
      }
    for (int v = 0; v < V; ++v) run_sum[v] = vfmadd(run_sum[v], alpha[v], tile_sum[v]);
    for (int64_t d0 = 0; d0 < head_dim; d0 += DR)
      accumulate_values<DR, V>(values, nk, st, alpha, ot, d0);
  }
  alignas(64) float inv[R];
  for (int v = 0; v < V; ++v) vstore(inv + W * v, vdiv(vset1(1.0f), run_sum[v]));
  for (int64_t m = 0; m < rows; ++m) {
    float* dst = out + (m / group) * out_stride + (m % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = ot[d * R + m] * inv[m];
  }
}

// prefill_rows<1> .. prefill_rows<kPrefillRows / W>, by number of row vectors.
template <size_t... I>
constexpr auto prefill_variants(std::index_sequence<I...>) {
  return std::array{&prefill_rows<static_cast<int>(I) + 1>...};
}
static_assert(kPrefillRows % W == 0, "prefill rows fill whole vectors");
constexpr auto kPrefillVariants =
    prefill_variants(std::make_index_sequence<static_cast<size_t>(kPrefillRows / W)>{});

void attend_prefill(const float* q, int64_t q_stride, int64_t tokens, int64_t group,
                    int64_t first_pos, const float* key_cache, const float* value_cache,
                    const int32_t* block_table, int64_t block_size, int64_t num_kv_heads,
                    int64_t kv_head, int64_t head_dim, float scale, float* scratch, float* out,
                    int64_t out_stride) {
  kPrefillVariants[(tokens * group + W - 1) / W - 1](
      q, q_stride, tokens, group, first_pos, key_cache, value_cache, block_table, block_size,
      num_kv_heads, kv_head, head_dim, scale, scratch, out, out_stride);
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
    const Vec inv = vset1(1.0f / total);
    int64_t t = 0;
    for (; t + W <= context_len; t += W) vstore(s + t, vmul(vload(s + t), inv));
    for (; t < context_len; ++t) s[t] /= total;
  }
  for (int64_t h = 0; h < group; ++h) {
    const float* p = scores + h * context_len;
    float* o = out + h * out_stride;
    switch (head_dim / W) {
      case 1: weighted_sum<1>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 2: weighted_sum<2>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 3: weighted_sum<3>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 4: weighted_sum<4>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 5: weighted_sum<5>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 6: weighted_sum<6>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 7: weighted_sum<7>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      case 8: weighted_sum<8>(p, value_cache, block_table, context_len, block_size, num_kv_heads, kv_head, o); break;
      default: {  // head_dim > 8 W: accumulate in `o` itself
        for (int64_t d = 0; d < head_dim; d += W) vstore(o + d, vzero());
        for (int64_t t = 0; t < context_len; ++t) {
          const float* v = value_cache + offset(t);
          const Vec pt = vset1(p[t]);
          for (int64_t d = 0; d < head_dim; d += W) vstore(o + d, vfmadd(pt, vload(v + d), vload(o + d)));
        }
      }
    }
  }
}

void silu_and_mul_row(const float* gate_up, float* out, int64_t dim) {
  const Vec one = vset1(1.0f);
  int64_t i = 0;
  for (; i + W <= dim; i += W) {  // silu(g) = g / (1 + e^-g)
    const Vec g = vload(gate_up + i);
    const Vec silu = vdiv(g, vadd(one, vexp(vsub(vzero(), g))));
    vstore(out + i, vmul(silu, vload(gate_up + dim + i)));
  }
  for (; i < dim; ++i) {
    const float g = gate_up[i];
    out[i] = g / (1.0f + std::exp(-g)) * gate_up[dim + i];
  }
}

}  // namespace

const KernelTable kernel_table = {linear_rows, linear_panels,  rms_norm_row,    rotate_head,
                                  attend,      attend_prefill, silu_and_mul_row};
