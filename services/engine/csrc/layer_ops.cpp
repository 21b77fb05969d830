// The decoder layer's elementwise work, one pass over memory each, where PyTorch takes several
// (rotary: neg, cat, two muls, an add; residual + RMSNorm: add, pow, mean, add, rsqrt, two muls and
// two dtype casts; SiLU-and-mul: silu, a slice and a mul, each a separate tensor).
//
// Every function rounds where transformers' eager float32 / bfloat16 code rounds (each bfloat16 op
// rounds its result to bfloat16; float32 products are never fused into FMAs: -ffp-contract=off), so
// the result equals the PyTorch code's bit for bit except for the order of the RMSNorm's sum and
// the exp inside SiLU (glibc's vector expf, within 4 ulp: -ffast-math is what makes GCC call it; a
// scalar expf per element made SiLU-and-mul slower than PyTorch's two passes).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <optional>

using bf16 = at::BFloat16;

static inline float f32(float x) { return x; }
static inline float f32(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// The value as the tensor's type stores it (a no-op for float32; round to nearest even for bfloat16).
template <typename T> static inline float rnd(float x) { return x; }
template <> inline float rnd<bf16>(float x) { return f32(bf16(x)); }

constexpr int64_t GRAIN = 16;  // rows per parallel task

// x: [T, W] with contiguous rows (any row stride); cos, sin: [T, D] of T. Rotates the first n_heads heads
// of width D of every row in place, GPT-NeoX style (halves): x * cos + rotate_half(x) * sin.
template <typename T>
static void rotary_impl(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t n_heads,
                        int64_t D) {
  const int64_t rows = x.size(0), stride = x.stride(0), half = D / 2;
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < n_heads; ++h) {
        T* v = xp + t * stride + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(v[i]), x2 = f32(v[i + half]);
          const float a1 = rnd<T>(x1 * f32(c[i])), b1 = rnd<T>(-x2 * f32(s[i]));
          const float a2 = rnd<T>(x2 * f32(c[i + half])), b2 = rnd<T>(x1 * f32(s[i + half]));
          v[i] = T(a1 + b1);
          v[i + half] = T(a2 + b2);
        }
      }
    }
  });
}

void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t n_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type());
  TORCH_CHECK(n_heads * head_dim <= x.size(1) && head_dim % 2 == 0 && cos.size(1) == head_dim);
  if (x.scalar_type() == torch::kFloat32) return rotary_impl<float>(x, cos, sin, n_heads, head_dim);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
  rotary_impl<bf16>(x, cos, sin, n_heads, head_dim);
}

// h: [T, C] contiguous, updated in place to h + a when a is given; returns weight * rms_norm(h) as
// transformers' LlamaRMSNorm computes it: in float32, cast back to h's type before the weight.
template <typename T>
static void add_rms_norm_impl(torch::Tensor& h, const T* a, const torch::Tensor& w, float eps, torch::Tensor& out) {
  const int64_t rows = h.size(0), C = h.size(1);
  T* hp = h.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* x = hp + t * C;
      float ss = 0.f;
      if (a != nullptr) {
        const T* y = a + t * C;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < C; ++i) {
          const float v = rnd<T>(f32(x[i]) + f32(y[i]));
          x[i] = T(v);
          ss += v * v;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < C; ++i) ss += f32(x[i]) * f32(x[i]);
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
      T* o = op + t * C;
#pragma omp simd
      for (int64_t i = 0; i < C; ++i) o[i] = T(f32(wp[i]) * rnd<T>(f32(x[i]) * inv));
    }
  });
}

torch::Tensor add_rms_norm_(torch::Tensor h, std::optional<torch::Tensor> a, torch::Tensor weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && weight.is_contiguous() && weight.numel() == h.size(1));
  TORCH_CHECK(weight.scalar_type() == h.scalar_type());
  if (a) TORCH_CHECK(a->is_contiguous() && a->sizes() == h.sizes() && a->scalar_type() == h.scalar_type());
  auto out = torch::empty_like(h);
  if (h.scalar_type() == torch::kFloat32) {
    add_rms_norm_impl<float>(h, a ? a->data_ptr<float>() : nullptr, weight, static_cast<float>(eps), out);
  } else {
    TORCH_CHECK(h.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
    add_rms_norm_impl<bf16>(h, a ? a->data_ptr<bf16>() : nullptr, weight, static_cast<float>(eps), out);
  }
  return out;
}

// gate_up: [T, 2I] contiguous (gate | up) -> silu(gate) * up, [T, I].
template <typename T>
static void silu_mul_impl(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t rows = gu.size(0), I = gu.size(1) / 2;
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = f32(g[i]);
        o[i] = T(rnd<T>(x / (1.f + std::exp(-x))) * f32(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0);
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_impl<float>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "float32 or bfloat16 only");
    silu_mul_impl<bf16>(gate_up, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_", &rotary_, "rotate the first n_heads heads of each row in place (NeoX halves)");
  m.def("add_rms_norm_", &add_rms_norm_, "h += a (if given) in place; returns weight * rms_norm(h)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate_up");
}
