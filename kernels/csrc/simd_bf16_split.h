// The bf16 dot products of the bf16 x bf16 kernel (bf16_bodies.h) without AVX512-BF16, after
// simd_avx512.h or simd_avx2.h: a vector of W weight pairs split into the fp32 of its odd and
// even weights (a mask and a shift, no shuffle), each multiplied by x's broadcast odd and
// even value with one fma: the odd first, as vdpbf16ps does. Each product of two bf16 values
// is exact in fp32, so each fma rounds once, as vdpbf16ps's sums do; MXCSR's flush-to-zero
// and denormals-are-zero bits are set while the kernel runs, as vdpbf16ps always has them.
constexpr int kBf16Rows = kVecRegisters == 32 ? 6 : 4;  // rows of x per bf16 register tile
constexpr int kWPairRegisters = 2;     // registers a WPair holds
struct WPair {
  Vec odd, even;
};
struct XPair {
  Vec odd, even;
};
// MXCSR with FTZ and DAZ set for as long as it lives, restored after.
class DenormalsFlushed {
 public:
  DenormalsFlushed() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtzDaz); }
  ~DenormalsFlushed() { _mm_setcsr(saved_); }
  DenormalsFlushed(const DenormalsFlushed&) = delete;
  DenormalsFlushed& operator=(const DenormalsFlushed&) = delete;

 private:
  static constexpr unsigned kFtzDaz = 0x8040;
  unsigned saved_;
};
inline WPair wpair(const uint16_t* p) {
  const Vec pairs = vload(reinterpret_cast<const float*>(p));
  return {vbf16_odd(pairs), vbf16_even(pairs)};
}
inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline XPair xpair(const uint16_t* p) {  // p: x[2 j], x[2 j + 1]
  return {vset1(bf16_value(p[1])), vset1(bf16_value(p[0]))};
}
inline Vec bdot(Vec acc, const XPair& x, const WPair& w) {
  return vfmadd(x.even, w.even, vfmadd(x.odd, w.odd, acc));
}
