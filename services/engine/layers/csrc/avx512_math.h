// Math shared by the AVX-512 kernels (each kernel is its own single-file extension; this header and vec16.h are all
// they share): exp, a reciprocal, and bfloat16 16 at a time. Not shared, on purpose: the sampler's exp and log
// (sampler.cpp, Cephes' polynomials as plain IEEE operations, bit for bit its PyTorch fallback) and the decode
// kernel's softmax exp (paged_attention.cpp, libmvec's expf, whose rounding the decode results were validated with).
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

// bfloat16 rows 16 at a time, as c10::BFloat16 converts one value: widened by a shift (bfloat16 is float32's upper
// half), narrowed with round-to-nearest-even; a NaN narrows to the quiet NaN 0x7fc0 (the rounding add would carry a
// NaN's payload into the exponent's neighbour: -0 or an infinity). GCC left these loops scalar, at half float32's
// speed for half its bytes. A row's tail past the last 16 goes through the scalar type.
namespace bf16x16 {
static inline __m512 load(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512i rounded(__m512 f) {  // the float's bits rounded to nearest even in the upper half
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
static inline void store(uint16_t* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded(f), 16)));
}
static inline __m512 rnd(__m512 f) {  // rounded to bfloat16 and widened back
  return _mm512_castsi512_ps(_mm512_and_si512(rounded(f), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
}  // namespace bf16x16
#endif
