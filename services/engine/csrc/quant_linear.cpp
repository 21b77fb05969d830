// Weight-only quantized linear layers over GGUF's blocks: y = x @ dequant(W).T + b, with x and y in float32.
//
// GGUF stores each output row of W as K / 32 blocks of 32 weights:
//   Q4_0 (18 bytes): float16 d, 16 bytes of nibbles           w = d * (q - 8)
//   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles w = d * q + m
//   Q8_0 (34 bytes): float16 d, 32 int8                        w = d * q
// where byte j of a 4-bit block holds weight j (low nibble) and weight j + 16 (high nibble). pack() lays each row
// out planar, in the same bytes: the row's d (float16 each), then its m (Q4_1), then the blocks' quantized values,
// so that one instruction converts 16 scales and the values are read as one stream.
//
// Decoding one sequence reads every weight once per token, so at small batches the step costs what the weights
// weigh: a sixth of float32's bytes for Q4_1. One row of x takes sum_b d_b (q_b . x_b) + sum_b m_b S_b (S_b: x's sum
// over block b, once per call); a tile of up to 8 rows decodes each block once (w = fma(q, d, m), the value gguf's
// dequantize gives, rounded once instead of twice) and multiplies it into every row of the tile, so at large
// batches the loop runs at the FMA units' rate. Rows of W are split between torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum Kind : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

static inline int64_t block_bytes(int64_t kind) { return kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : 34; }
// Bytes of a packed row before its values: d (and m for Q4_1), float16 each.
static inline int64_t scale_bytes(int64_t kind, int64_t nb) { return (kind == Q4_1 ? 4 : 2) * nb; }

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400));
    bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// A packed row's K weights as floats, portable C++ (dequantize(), and the kernel where AVX-512 is absent).
template <int64_t KIND>
static void decode_row(const uint8_t* row, int64_t nb, float* w) {
  const uint8_t* qs = row + scale_bytes(KIND, nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float d = half_to_float(row + 2 * b);
    float* o = w + 32 * b;
    if constexpr (KIND == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(qs + 32 * b);
      for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
    } else {
      const float m = KIND == Q4_1 ? half_to_float(row + 2 * nb + 2 * b) : -8.0f * d;
      const uint8_t* q = qs + 16 * b;
      for (int j = 0; j < 16; ++j) {
        o[j] = std::fma(static_cast<float>(q[j] & 0x0F), d, m);
        o[j + 16] = std::fma(static_cast<float>(q[j] >> 4), d, m);
      }
    }
  }
}

#if defined(__AVX512F__)
// A row's float16 scales (n of them, at h) as floats at f.
static inline void halves_to_floats(const uint8_t* h, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 2 * i))));
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(f + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + 2 * i)));
  }
}

// A row's scales d and offsets m (w = d * q + m) as floats; Q8_0 has no offset.
template <int64_t KIND>
static inline void row_scales(const uint8_t* row, int64_t nb, float* d, float* m) {
  halves_to_floats(row, d, nb);
  if constexpr (KIND == Q4_1) halves_to_floats(row + 2 * nb, m, nb);
  if constexpr (KIND == Q4_0)
    for (int64_t b = 0; b < nb; ++b) m[b] = -8.0f * d[b];
}

// Block b's 32 quantized values as floats, unscaled: lanes 0-15 in q0, 16-31 in q1.
template <int64_t KIND>
static inline void block_values(const uint8_t* qs, int64_t b, __m512& q0, __m512& q1) {
  if constexpr (KIND == Q8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(qs + 32 * b);
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  } else {
    const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * b)));
    q0 = _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(0x0F)));
    q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4));
  }
}

// Rows [n0, n1) of y for a tile of RT >= 2 rows of x: each block decoded once (w = fma(q, d, m)) and multiplied into
// every row of the tile.
template <int64_t KIND, int RT>
static void tile_avx512(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0,
                        int64_t n1, float* y, int64_t ldy, const float* bias, float* d, float* m) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    row_scales<KIND>(row, nb, d, m);
    const uint8_t* qs = row + scale_bytes(KIND, nb);
    __m512 acc0[RT], acc1[RT];
    for (int r = 0; r < RT; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 w0, w1;
      block_values<KIND>(qs, b, w0, w1);
      const __m512 db = _mm512_set1_ps(d[b]);
      if constexpr (KIND == Q8_0) {
        w0 = _mm512_mul_ps(w0, db);
        w1 = _mm512_mul_ps(w1, db);
      } else {
        const __m512 mb = _mm512_set1_ps(m[b]);
        w0 = _mm512_fmadd_ps(w0, db, mb);
        w1 = _mm512_fmadd_ps(w1, db, mb);
      }
      const float* xb = x + b * 32;
      for (int r = 0; r < RT; ++r) {
        acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb + r * ldx), acc0[r]);
        acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + r * ldx + 16), acc1[r]);
      }
    }
    const float bn = bias ? bias[n] : 0.0f;
    for (int r = 0; r < RT; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r])) + bn;
  }
}

// One row of x (decoding a sequence): sum_b d_b (q_b . x_b) + sum_b m_b S_b with S_b the sum of x over block b,
// taken once per call, so a block costs its conversion and three vector operations.
template <int64_t KIND>
static void row_avx512(const float* x, const float* S, const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0,
                       int64_t n1, float* y, const float* bias, float* d, float* m) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    row_scales<KIND>(row, nb, d, m);
    const uint8_t* qs = row + scale_bytes(KIND, nb);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, am = a0;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      __m512 q0, q1, q2, q3;
      block_values<KIND>(qs, b, q0, q1);
      block_values<KIND>(qs, b + 1, q2, q3);
      const float* xb = x + b * 32;
      const __m512 t0 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
      const __m512 t1 = _mm512_fmadd_ps(q3, _mm512_loadu_ps(xb + 48), _mm512_mul_ps(q2, _mm512_loadu_ps(xb + 32)));
      a0 = _mm512_fmadd_ps(t0, _mm512_set1_ps(d[b]), a0);
      a1 = _mm512_fmadd_ps(t1, _mm512_set1_ps(d[b + 1]), a1);
    }
    if (b < nb) {
      __m512 q0, q1;
      block_values<KIND>(qs, b, q0, q1);
      const float* xb = x + b * 32;
      const __m512 t0 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
      a0 = _mm512_fmadd_ps(t0, _mm512_set1_ps(d[b]), a0);
    }
    if constexpr (KIND != Q8_0) {
      int64_t c = 0;
      for (; c + 16 <= nb; c += 16) am = _mm512_fmadd_ps(_mm512_loadu_ps(m + c), _mm512_loadu_ps(S + c), am);
      if (c < nb) {
        const __mmask16 k = static_cast<__mmask16>((1u << (nb - c)) - 1);
        am = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + c), _mm512_maskz_loadu_ps(k, S + c), am);
      }
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), am)) + (bias ? bias[n] : 0.0f);
  }
}
#endif

// Portable: each weight row decoded into a float buffer, then a dot product with every row of x.
template <int64_t KIND>
static void rows_portable(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                          int64_t n1, float* y, int64_t ldy, const float* bias) {
  std::vector<float> buf(K);
  for (int64_t n = n0; n < n1; ++n) {
    decode_row<KIND>(w + n * row_bytes, K / 32, buf.data());
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t r = 0; r < M; ++r) {
      const float* xr = x + r * K;
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += buf[k] * xr[k];
      y[r * ldy + n] = s + b;
    }
  }
}

constexpr int64_t PANEL = 64;  // rows of x per pass over a thread's weight rows (x's panel stays in L2)

template <int64_t KIND>
static void linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                        float* y, const float* bias) {
  const int64_t nb = K / 32;
#if defined(__AVX512F__)
  std::vector<float> S;
  if (M == 1) {
    S.resize(nb);
    for (int64_t b = 0; b < nb; ++b)
      S[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + 32 * b), _mm512_loadu_ps(x + 32 * b + 16)));
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#if defined(__AVX512F__)
    std::vector<float> scales(2 * nb + 32);
    float *d = scales.data(), *m = scales.data() + nb + 16;
    if (M == 1) {
      row_avx512<KIND>(x, S.data(), w, row_bytes, nb, n0, n1, y, bias, d, m);
      return;
    }
    for (int64_t p = 0; p < M; p += PANEL) {
      const int64_t pend = std::min(M, p + PANEL);
      int64_t r = p;
      for (; r + 8 <= pend; r += 8)
        tile_avx512<KIND, 8>(x + r * K, K, w, row_bytes, nb, n0, n1, y + r * N, N, bias, d, m);
      const float* xr = x + r * K;
      float* yr = y + r * N;
      switch (pend - r) {
        case 7: tile_avx512<KIND, 7>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 6: tile_avx512<KIND, 6>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 5: tile_avx512<KIND, 5>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 4: tile_avx512<KIND, 4>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 3: tile_avx512<KIND, 3>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 2: tile_avx512<KIND, 2>(xr, K, w, row_bytes, nb, n0, n1, yr, N, bias, d, m); break;
        case 1: {
          std::vector<float> S1(nb);
          for (int64_t b = 0; b < nb; ++b) {
            float s = 0.0f;
            for (int j = 0; j < 32; ++j) s += xr[32 * b + j];
            S1[b] = s;
          }
          row_avx512<KIND>(xr, S1.data(), w, row_bytes, nb, n0, n1, yr, bias, d, m);
          break;
        }
        default: break;
      }
    }
#else
    rows_portable<KIND>(x, M, K, w, row_bytes, n0, n1, y, N, bias);
#endif
  });
}

static void check_weight(const torch::Tensor& w, int64_t kind, int64_t K) {
  TORCH_CHECK(kind == Q4_0 || kind == Q4_1 || kind == Q8_0, "unknown quantization kind ", kind);
  TORCH_CHECK(K > 0 && K % 32 == 0, "the input width must be a positive multiple of 32, not ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "weights: a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(w.size(1) == K / 32 * block_bytes(kind), "weights: rows of ", w.size(1), " bytes, not ",
              K / 32 * block_bytes(kind), " for width ", K);
}

// GGUF's rows of blocks [N, K / 32 * block bytes] -> the planar rows the kernel reads (same size).
torch::Tensor pack(const torch::Tensor& w, int64_t kind, int64_t K) {
  check_weight(w, kind, K);
  const int64_t N = w.size(0), nb = K / 32, bb = block_bytes(kind), rb = w.size(1), sb = scale_bytes(kind, nb);
  const int64_t vb = kind == Q8_0 ? 32 : 16;  // value bytes per block
  torch::Tensor out = torch::empty_like(w);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + n * rb + b * bb;
        uint8_t* row = dst + n * rb;
        std::memcpy(row + 2 * b, blk, 2);
        if (kind == Q4_1) std::memcpy(row + 2 * nb + 2 * b, blk + 2, 2);
        std::memcpy(row + sb + vb * b, blk + (bb - vb), vb);
      }
  });
  return out;
}

// y [M, N] = x [M, K] @ dequant(w).T (+ bias [N]), w packed.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t kind, int64_t K,
                     const c10::optional<torch::Tensor>& bias) {
  check_weight(w, kind, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32,
              "input: a float32 [M, ", K, "] tensor");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32, "bias: float32 [", N, "]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (kind) {
    case Q4_0: linear_impl<Q4_0>(xp, M, K, wp, N, w.size(1), yp, bp); break;
    case Q4_1: linear_impl<Q4_1>(xp, M, K, wp, N, w.size(1), yp, bp); break;
    default: linear_impl<Q8_0>(xp, M, K, wp, N, w.size(1), yp, bp); break;
  }
  return y;
}

// The float32 weights of packed rows w [R, row bytes] (an embedding lookup's rows, or a whole matrix).
torch::Tensor dequantize(const torch::Tensor& w, int64_t kind, int64_t K) {
  check_weight(w, kind, K);
  const int64_t R = w.size(0), nb = K / 32, rb = w.size(1);
  torch::Tensor out = torch::empty({R, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (kind == Q4_0) decode_row<Q4_0>(wp + r * rb, nb, op + r * K);
      else if (kind == Q4_1) decode_row<Q4_1>(wp + r * rb, nb, op + r * K);
      else decode_row<Q8_0>(wp + r * rb, nb, op + r * K);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "GGUF rows of blocks as the planar rows linear() reads", py::arg("w"), py::arg("kind"),
        py::arg("K"));
  m.def("linear", &linear, "y = x @ dequant(w).T + bias over packed GGUF blocks", py::arg("x"), py::arg("w"),
        py::arg("kind"), py::arg("K"), py::arg("bias") = py::none());
  m.def("dequantize", &dequantize, "float32 rows of packed GGUF blocks", py::arg("w"), py::arg("kind"), py::arg("K"));
}
