// The store of a register tile of MR rows x V vectors into y [M, N] at columns n0 ..
// n0 + cols (cols < V W at the last panel: through a row buffer). Shared by kernel_bodies.h
// and q8_bodies.h; included inside an instruction set's namespace, after its vocabulary, once
// per translation unit (hence the guard).
#ifndef SKIFF_TILE_STORE_H
#define SKIFF_TILE_STORE_H

template <int MR, int V>
inline void store_tile(const Vec (&acc)[MR][V], float* y, int64_t N, int64_t n0,
                       int64_t cols) {
  alignas(64) float row[V * W];
  for (int m = 0; m < MR; ++m) {
    if (cols == V * W) {
      for (int j = 0; j < V; ++j) vstore(y + m * N + n0 + j * W, acc[m][j]);
    } else {
      for (int j = 0; j < V; ++j) vstore(row + j * W, acc[m][j]);
      std::copy_n(row, cols, y + m * N + n0);
    }
  }
}

#endif  // SKIFF_TILE_STORE_H
