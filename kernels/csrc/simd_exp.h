// e^x for x already clamped to [-87, 89], W at a time, over the vector vocabulary included
// before it (simd_avx512.h or simd_avx2.h): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor series to r^7 (relative error ~1e-8, below fp32 rounding), times 2^n. No include
// guard: included once per instruction set, after the vocabulary.

inline Vec exp_clamped(Vec x) {
  const Vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  Vec r = vfnmadd(n, vset1(0.693145751953125f), x);     // ln2, high bits
  r = vfnmadd(n, vset1(1.428606765330187045e-06f), r);  // ln2, the rest
  Vec p = vset1(1.0f / 5040);
  p = vfmadd(p, r, vset1(1.0f / 720));
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vscale2(p, n);
}
