// Math shared by the AVX-512 kernels (each kernel is its own single-file extension; this header is all they share).
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

namespace avx512 {
// exp(x), 16 lanes, inline: 2^(x log2 e) as 2^n (scalef) times a degree-6 Taylor polynomial of 2^f, |f| <= 1/2.
// Relative error under 6e-6 over [-87, 88] (most of it from rounding x log2 e to float32), far below bfloat16's
// rounding, which every caller applies next; glibc's vector expf (4 ulp) costs a call and a trip through memory.
// Arguments outside [-87, 88] are clamped there (exp of -87 is ~1.6e-38, of 88 ~1.7e38: the softmax and the
// SiLU that call this need nothing past them).
static inline __m512 exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 y = _mm512_set1_ps(1.5403530e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504109e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022651e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// 1 / d to ~2^-28 relative (rcp14 and one Newton step), where _mm512_div_ps costs ~16 cycles a vector.
static inline __m512 reciprocal(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}
}  // namespace avx512
#endif
