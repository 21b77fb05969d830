// Math shared by the AVX-512 kernels (each kernel is its own single-file extension; this header is all they share).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace avx512 {
// exp(x), 16 lanes, inline, within ~2 ulp of float32 (the same few ulps as glibc's vector expf, without its call and
// trip through memory): x = n ln 2 + r with ln 2 in two parts (Cody and Waite), so |r| <= ln(2) / 2 exactly enough,
// e^r by its degree-7 Taylor polynomial (truncation < 6e-9 there), times 2^n (scalef). Arguments are clamped to
// [-87, 88] (e^-87 ~ 1.6e-38, e^88 ~ 1.7e38): the softmax and the SiLU that call this need nothing past them.
static inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2's top bits: n * this is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // and the rest of ln 2
  __m512 y = _mm512_set1_ps(1.f / 5040);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 720));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// 1 / d to ~2^-28 relative (rcp14 and one Newton step), where _mm512_div_ps costs ~16 cycles a vector.
static inline __m512 reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}
}  // namespace avx512
#endif
