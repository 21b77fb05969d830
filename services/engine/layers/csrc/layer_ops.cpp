// The decoder layer's elementwise work, one pass over memory each, where PyTorch takes several
// (rotary: neg, cat, two muls, an add; residual + RMSNorm: add, pow, mean, add, rsqrt, two muls and
// two dtype casts; SiLU-and-mul: silu, a slice and a mul, each a separate tensor).
//
// Every function rounds where transformers' eager float32 / bfloat16 code rounds (each bfloat16 op
// rounds its result to bfloat16; float32 products are never fused into FMAs: -ffp-contract=off), so
// the result equals the PyTorch code's bit for bit except for the order of the RMSNorm's sum and
// the exp inside SiLU (float32: glibc's vector expf, within 4 ulp: -ffast-math is what makes GCC call it; a
// scalar expf per element made SiLU-and-mul slower than PyTorch's two passes; bfloat16: avx512_math.h's inline exp
// (~2 ulp) and reciprocal, before the result is rounded to bfloat16).
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

// Element types as the loops see them: storage type S, widened to float by load, rounded back by store.
// bfloat16 is handled as its 16 bits with plain integer ops (round to nearest even, as c10::BFloat16
// does for every finite value), so GCC vectorizes the loops; c10::BFloat16's own conversions kept them
// scalar (bfloat16 SiLU-and-mul ran at half the speed of a bfloat16 GEMM of the same rows).
struct F32 {
  using S = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
};
struct BF16 {
  using S = uint16_t;
  static inline float load(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static inline uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};
// The value as the tensor's type stores it (a no-op for float32).
template <typename E> static inline float rnd(float x) { return E::load(E::store(x)); }
template <typename E> static inline typename E::S* ptr(const torch::Tensor& t) {
  return reinterpret_cast<typename E::S*>(t.data_ptr());
}

constexpr int64_t GRAIN = 16;  // rows per parallel task

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "avx512_math.h"  // bf16x16: bfloat16 rows 16 at a time (RMSNorm's row of a width not a multiple of 16: whole
                           // through BF16 itself)
#define MESHSERVE_BF16X16 1
#endif

// x: [T, W] with contiguous rows (any row stride); cos, sin: [T, D] of T. Rotates the first n_heads heads
// of width D of every row in place, GPT-NeoX style (halves): x * cos + rotate_half(x) * sin.
template <typename E>
static void rotary_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads,
                        int64_t D) {
  using T = typename E::S;
  const int64_t rows = x.size(0), stride = x.stride(0), half = D / 2;
  T* xp = ptr<E>(x);
  const T* cp = ptr<E>(cos);
  const T* sp = ptr<E>(sin);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < n_heads; ++h) {
        T* v = xp + t * stride + h * D;
        int64_t vec = 0;  // the elements done 16 at a time
#ifdef MESHSERVE_BF16X16
        if constexpr (std::is_same_v<E, BF16>) {
          using namespace bf16x16;
          for (int64_t i = 0; i + 16 <= half; i += 16, vec = i) {
            const __m512 x1 = load(v + i), x2 = load(v + i + half);
            const __m512 a1 = rnd(_mm512_mul_ps(x1, load(c + i)));
            const __m512 b1 = rnd(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load(s + i)));
            const __m512 a2 = rnd(_mm512_mul_ps(x2, load(c + i + half)));
            const __m512 b2 = rnd(_mm512_mul_ps(x1, load(s + i + half)));
            store(v + i, _mm512_add_ps(a1, b1));
            store(v + i + half, _mm512_add_ps(a2, b2));
          }
        }
#endif
#pragma omp simd
        for (int64_t i = vec; i < half; ++i) {
          const float x1 = E::load(v[i]), x2 = E::load(v[i + half]);
          const float a1 = rnd<E>(x1 * E::load(c[i])), b1 = rnd<E>(-x2 * E::load(s[i]));
          const float a2 = rnd<E>(x2 * E::load(c[i + half])), b2 = rnd<E>(x1 * E::load(s[i + half]));
          v[i] = E::store(a1 + b1);
          v[i + half] = E::store(a2 + b2);
        }
      }
    }
  });
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type());
  TORCH_CHECK(n_heads * head_dim <= x.size(1) && head_dim % 2 == 0 && cos.size(1) == head_dim);
  if (x.scalar_type() == torch::kFloat32) return rotary_impl<F32>(x, cos, sin, n_heads, head_dim);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
  rotary_impl<BF16>(x, cos, sin, n_heads, head_dim);
}

// h: [T, C] contiguous, updated in place to h + a when a is given; returns weight * rms_norm(h) as
// transformers' LlamaRMSNorm computes it: in float32, cast back to h's type before the weight.
template <typename E>
static void add_rms_norm_impl(torch::Tensor& h, const std::optional<torch::Tensor>& added, const torch::Tensor& w,
                              float eps, torch::Tensor& out) {
  using T = typename E::S;
  const int64_t rows = h.size(0), C = h.size(1);
  T* hp = ptr<E>(h);
  const T* a = added ? ptr<E>(*added) : nullptr;
  const T* wp = ptr<E>(w);
  T* op = ptr<E>(out);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = hp + t * C;
      float ss = 0.f;
      T* o = op + t * C;
#ifdef MESHSERVE_BF16X16
      if constexpr (std::is_same_v<E, BF16>) {
        if (C % 16 == 0) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < C; i += 16) {
            __m512 v = bf16x16::load(x + i);
            if (a != nullptr) {
              v = bf16x16::rnd(_mm512_add_ps(v, bf16x16::load(a + t * C + i)));
              bf16x16::store(x + i, v);
            }
            acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
          }
          const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(C) + eps));
          for (int64_t i = 0; i < C; i += 16)
            bf16x16::store(o + i, _mm512_mul_ps(bf16x16::load(wp + i), bf16x16::rnd(_mm512_mul_ps(bf16x16::load(x + i),
                                                                                                   inv))));
          continue;
        }
      }
#endif
      if (a != nullptr) {
        const T* y = a + t * C;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < C; ++i) {
          const float v = rnd<E>(E::load(x[i]) + E::load(y[i]));
          x[i] = E::store(v);
          ss += v * v;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < C; ++i) ss += E::load(x[i]) * E::load(x[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
#pragma omp simd
      for (int64_t i = 0; i < C; ++i) o[i] = E::store(E::load(wp[i]) * rnd<E>(E::load(x[i]) * inv));
    }
  });
}

torch::Tensor add_rms_norm_(torch::Tensor h, std::optional<torch::Tensor> a, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && weight.is_contiguous() && weight.numel() == h.size(1));
  TORCH_CHECK(weight.scalar_type() == h.scalar_type());
  if (a) TORCH_CHECK(a->is_contiguous() && a->sizes() == h.sizes() && a->scalar_type() == h.scalar_type());
  auto out = torch::empty_like(h);
  if (h.scalar_type() == torch::kFloat32) {
    add_rms_norm_impl<F32>(h, a, weight, static_cast<float>(eps), out);
  } else {
    TORCH_CHECK(h.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
    add_rms_norm_impl<BF16>(h, a, weight, static_cast<float>(eps), out);
  }
  return out;
}

// gate_up: [T, 2I] contiguous (gate | up) -> silu(gate) * up, [T, I].
template <typename E>
static void silu_mul_impl(const torch::Tensor& gu, torch::Tensor& out) {
  using T = typename E::S;
  const int64_t rows = gu.size(0), I = gu.size(1) / 2;
  const T* gp = ptr<E>(gu);
  T* op = ptr<E>(out);
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      int64_t vec = 0;  // the elements done 16 at a time
#ifdef MESHSERVE_BF16X16
      if constexpr (std::is_same_v<E, BF16>) {
        for (int64_t i = 0; i + 16 <= I; i += 16, vec = i) {
          const __m512 x = bf16x16::load(g + i);
          const __m512 one = _mm512_set1_ps(1.f);
          const __m512 s = bf16x16::rnd(_mm512_mul_ps(x, avx512::reciprocal(_mm512_add_ps(one, avx512::exp(
              _mm512_sub_ps(_mm512_setzero_ps(), x))))));
          bf16x16::store(o + i, _mm512_mul_ps(s, bf16x16::load(u + i)));
        }
      }
#endif
#pragma omp simd
      for (int64_t i = vec; i < I; ++i) {
        const float x = E::load(g[i]);
        o[i] = E::store(rnd<E>(x / (1.f + std::exp(-x))) * E::load(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0);
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_impl<F32>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
    silu_mul_impl<BF16>(gate_up, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_", &rotary_, "rotate the first n_heads heads of each row in place (NeoX halves)");
  m.def("add_rms_norm_", &add_rms_norm_, "h += a (if given) in place; returns weight * rms_norm(h)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate_up");
}
