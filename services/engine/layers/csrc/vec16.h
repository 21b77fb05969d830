// Sixteen float32 lanes: one AVX-512 register, or two AVX2 registers. Code written over Vec16 compiles at both
// levels (the prompt kernel's float32 and widened-bfloat16 paths); what only one ISA has (AMX tiles, vdpbf16ps)
// stays in raw intrinsics beside it. Everything is inline and every count fixed, so nothing leaves the registers.
#pragma once
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <c10/util/BFloat16.h>
#include <cstdint>
#include "avx512_math.h"

#define MESHSERVE_VEC16 1
#if defined(__AVX512F__)
#define MESHSERVE_VEC16_ISA "AVX-512"
#else
#define MESHSERVE_VEC16_ISA "AVX2"
#endif
using bf16 = at::BFloat16;

#if defined(__AVX512F__)
struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 all(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const bf16* p) {  // widened: bfloat16 is the top half of a float32
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
  }
  // lanes 0 .. n - 1 of p (n <= 16); the others `fill`, their memory untouched
  static Vec16 load_first(const float* p, int n, float fill) {
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), p)};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {  // rounded to nearest even
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#endif
  }
  Vec16 first(int n) const { return {_mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), v)}; }  // others 0
  float max() const { return _mm512_reduce_max_ps(v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
  friend Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c
  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec16 exp(Vec16 a) { return {avx512::exp(a.v)}; }
};
#else
namespace avx2 {
// exp(x), 8 lanes: avx512::exp's algorithm (Cody-Waite reduction, degree-7 Taylor polynomial, ~2 ulp), with 2^n
// built in the exponent field, where AVX2 has no scalef (n stays in -126 .. 127 for the clamped arguments).
static inline __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline __m256i lanes_below(int n) {  // all ones in lanes 0 .. n - 1 (n may be past 8 or below 0)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 widen(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void store_bf16(bf16* p, __m256 f) {  // rounded to nearest even
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // 32-bit lanes to 16-bit, in order: packus works per 128-bit half, so the halves are put side by side first
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

static inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
}  // namespace avx2

struct Vec16 {
  __m256 lo, hi;
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 all(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec16 load(const bf16* p) { return {avx2::widen(p), avx2::widen(p + 8)}; }
  static Vec16 load_first(const float* p, int n, float fill) {
    const __m256i a = avx2::lanes_below(n), b = avx2::lanes_below(n - 8);
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, a), _mm256_castsi256_ps(a)),
            _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, b), _mm256_castsi256_ps(b))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, lo), _mm256_storeu_ps(p + 8, hi); }
  void store(bf16* p) const { avx2::store_bf16(p, lo), avx2::store_bf16(p + 8, hi); }
  Vec16 first(int n) const {
    return {_mm256_and_ps(lo, _mm256_castsi256_ps(avx2::lanes_below(n))),
            _mm256_and_ps(hi, _mm256_castsi256_ps(avx2::lanes_below(n - 8)))};
  }
  float max() const { return avx2::hmax(_mm256_max_ps(lo, hi)); }
  float sum() const { return avx2::hsum(_mm256_add_ps(lo, hi)); }
  friend Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  friend Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  friend Vec16 max(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  friend Vec16 exp(Vec16 a) { return {avx2::exp(a.lo), avx2::exp(a.hi)}; }
};
#endif
#endif
