// Weight-only quantized linear layers over GGUF's blocks: y = x @ dequant(W).T + b, with x and y in float32.
//
// GGUF stores each output row of W as K / 32 blocks of 32 weights:
//   Q4_0 (18 bytes): float16 d, 16 bytes of nibbles           w = d * (q - 8)
//   Q4_1 (20 bytes): float16 d, float16 m, 16 bytes of nibbles w = d * q + m
//   Q8_0 (34 bytes): float16 d, 32 int8                        w = d * q
// where byte j of a 4-bit block holds weight j (low nibble) and weight j + 16 (high nibble). The file's other types
// are repacked at load (services/engine/layers/quant.py) into blocks of 32 of the same shape with float32 scales,
// each weight the same float as gguf's dequantize gives:
//   Q4_1F (24 bytes): float32 d, float32 m, 16 bytes of nibbles  w = d * q + m   (Q4_K: d = d * sc, m = -dmin * min)
//   Q8_1F (40 bytes): float32 d, float32 m, 32 int8             w = d * q + m   (Q5_K)
//   Q8_16F (40 bytes): float32 d0, float32 d1, 32 int8          w = d0 * q (first 16), d1 * q (last 16)   (Q6_K)
// and Q5_0 into Q8_0 (w = d * (q - 16), its 5-bit values as int8).
//
// pack() interleaves the rows in groups of 16 (the last group padded with zero rows), in the same bytes per row:
// for each block of a group, the 16 rows' d (float16), then their m (Q4_1), then the values with the 16 rows
// innermost (byte j of row i at j * 16 + i; Q8_0: value k of row i at k * 16 + i). One load then gives a weight
// of 16 output rows, so every loop keeps 16 outputs per vector and never reduces across lanes.
//
// One row of x (decoding one sequence) reads every weight once per token, so the step costs what the weights weigh:
// a sixth of float32's bytes for Q4_1. Each group's values are converted and multiplied by x's broadcast elements
// as they are read (sum_b d_b (q_b . x_b) + m_b S_b, with S_b x's sum over block b); so are they for up to 8 rows,
// each converted value multiplied into every row. More rows: each pair of groups is decoded once per panel of 64 rows of x into floats (w = fma(q, d, m): the value gguf's dequantize gives,
// rounded once instead of twice) and multiplied into the panel 8 rows at a time, 16 accumulators for 2 weight loads
// and 8 broadcasts per input element: the loop runs at the FMA units' rate, as a float32 GEMM does. Groups are split
// between torch's intra-op threads.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

enum Kind : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_1F = 3, Q8_1F = 4, Q8_16F = 5 };
constexpr int64_t KINDS = 6;
// What a kind's block holds: 4-bit values (else int8), float32 scales (else float16), a term m * sum(x) per block.
static constexpr bool nibbles(int64_t kind) { return kind == Q4_0 || kind == Q4_1 || kind == Q4_1F; }
static constexpr bool f32_scales(int64_t kind) { return kind >= Q4_1F; }
static constexpr bool has_min(int64_t kind) { return kind != Q8_0 && kind != Q8_16F; }
// A block's scale bytes (d, and m or d1), and the size of one scale.
static constexpr int64_t scale_bytes(int64_t kind) {
  return kind == Q4_0 || kind == Q8_0 ? 2 : kind == Q4_1 ? 4 : 8;
}
static constexpr int64_t scale_size(int64_t kind) { return f32_scales(kind) ? 4 : 2; }
constexpr int64_t G = 16;      // rows per group
constexpr int64_t PANEL = 64;  // rows of x per pass over the decoded groups (the panel stays in L2)
constexpr int64_t KC = 128;    // inputs per chunk: 4 decoded groups' chunk is 32 KB, in L1
constexpr int64_t GP = 4;      // groups decoded per pass: 64 outputs, 24 accumulators with 6 rows of x
constexpr int64_t SMALL_BATCH = 8;  // up to this many rows of x, values are converted as they are read (no buffer)

static constexpr int64_t block_bytes(int64_t kind) { return scale_bytes(kind) + (nibbles(kind) ? 16 : 32); }
// Within a group's block: where the values start (after the 16 rows' scales).
static constexpr int64_t values_at(int64_t kind) { return scale_bytes(kind) * G; }

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

static inline float float_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// Weight (lane i, element k) of one group's block gb, portable C++.
template <int64_t KIND>
static inline float weight_at(const uint8_t* gb, int64_t i, int64_t k) {
  const uint8_t* v = gb + values_at(KIND);
  if constexpr (KIND == Q8_16F) {
    const float d = float_at(gb + (k < 16 ? 0 : 4 * G) + 4 * i);
    return static_cast<float>(reinterpret_cast<const int8_t*>(v)[k * G + i]) * d;
  } else if constexpr (f32_scales(KIND)) {
    const float d = float_at(gb + 4 * i), m = float_at(gb + 4 * G + 4 * i);
    if constexpr (KIND == Q8_1F) return std::fma(static_cast<float>(reinterpret_cast<const int8_t*>(v)[k * G + i]), d, m);
    const uint8_t byte = v[(k & 15) * G + i];
    return std::fma(static_cast<float>(k < 16 ? byte & 0x0F : byte >> 4), d, m);
  } else {
    const float d = half_to_float(gb + 2 * i);
    if constexpr (KIND == Q8_0) {
      return static_cast<float>(reinterpret_cast<const int8_t*>(v)[k * G + i]) * d;
    } else {
      const float m = KIND == Q4_1 ? half_to_float(gb + 2 * G + 2 * i) : -8.0f * d;
      const uint8_t byte = v[(k & 15) * G + i];
      return std::fma(static_cast<float>(k < 16 ? byte & 0x0F : byte >> 4), d, m);
    }
  }
}

// A group's K weights of 16 rows as floats, out[k * 16 + i], portable C++.
template <int64_t KIND>
static void decode_group_portable(const uint8_t* g, int64_t nb, float* out) {
  const int64_t gbb = G * block_bytes(KIND);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k < 32; ++k)
      for (int64_t i = 0; i < G; ++i) out[(b * 32 + k) * G + i] = weight_at<KIND>(g + b * gbb, i, k);
}

#if defined(__AVX512F__)
// The 16 rows' d and m of a block (Q8_16F: m is d1, the last 16 values' scale).
template <int64_t KIND>
static inline void group_scales(const uint8_t* gb, __m512& d, __m512& m) {
  if constexpr (f32_scales(KIND)) {
    d = _mm512_loadu_ps(reinterpret_cast<const float*>(gb));
    m = _mm512_loadu_ps(reinterpret_cast<const float*>(gb + 4 * G));
    return;
  }
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
  if constexpr (KIND == Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 2 * G)));
  else if constexpr (KIND == Q4_0) m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
  else m = _mm512_setzero_ps();
}

static inline __m512i load_bytes(const uint8_t* p, bool sign) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// A group's K weights of 16 rows as floats: out[k * 16 + i].
template <int64_t KIND>
static void decode_group(const uint8_t* g, int64_t nb, float* out) {
  const int64_t gbb = G * block_bytes(KIND);
  for (int64_t b = 0; b < nb; ++b, out += 32 * G) {
    const uint8_t* gb = g + b * gbb;
    const uint8_t* v = gb + values_at(KIND);
    __m512 d, m;
    group_scales<KIND>(gb, d, m);
    if constexpr (KIND == Q8_0 || KIND == Q8_16F) {
      for (int k = 0; k < 32; ++k)
        _mm512_storeu_ps(out + k * G, _mm512_mul_ps(_mm512_cvtepi32_ps(load_bytes(v + k * G, true)),
                                                    KIND == Q8_16F && k >= 16 ? m : d));
    } else if constexpr (KIND == Q8_1F) {
      for (int k = 0; k < 32; ++k)
        _mm512_storeu_ps(out + k * G, _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + k * G, true)), d, m));
    } else {
      for (int j = 0; j < 16; ++j) {
        const __m512i z = load_bytes(v + j * G, false);
        _mm512_storeu_ps(out + j * G, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15))),
                                                      d, m));
        _mm512_storeu_ps(out + (j + 16) * G, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4)), d, m));
      }
    }
  }
}

// y[r, n + 16 j + i] for RT rows of x and NG decoded groups (w: NG groups of K x 16 floats) over inputs [k0, k1):
// the first chunk starts the sums, the others add to what y holds, the last adds the bias.
template <int RT, int NG>
static inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, int64_t k0, int64_t k1, float* y,
                         int64_t ldy, int64_t n, int64_t N, const float* bias) {
  __m512 acc[RT][NG];
  __mmask16 live[NG];
  for (int j = 0; j < NG; ++j) {
    const int64_t left = std::max<int64_t>(0, std::min<int64_t>(G, N - (n + j * G)));
    live[j] = static_cast<__mmask16>(left == G ? 0xFFFF : (1u << left) - 1);
  }
  for (int r = 0; r < RT; ++r)
    for (int j = 0; j < NG; ++j)
      acc[r][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live[j], y + r * ldy + n + j * G);
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NG];
    for (int j = 0; j < NG; ++j) wv[j] = _mm512_loadu_ps(w + (j * K + k) * G);
    for (int r = 0; r < RT; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int j = 0; j < NG; ++j) {
    if (!live[j]) break;
    const int64_t n0 = n + j * G;
    const __m512 bv = bias && k1 == K ? _mm512_maskz_loadu_ps(live[j], bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < RT; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, live[j], _mm512_add_ps(acc[r][j], bv));
  }
}

// The last rows of a panel (fewer than 8) against NG decoded groups.
template <int NG>
static inline void few_rows(int64_t left, const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* y,
                            int64_t ldy, int64_t n, int64_t N, const float* bias) {
  switch (left) {
    case 7: micro<7, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 6: micro<6, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 5: micro<5, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 4: micro<4, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 3: micro<3, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 2: micro<2, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    case 1: micro<1, NG>(x, K, w, K, k0, k1, y, ldy, n, N, bias); break;
    default: break;
  }
}

// A panel of rows of x against NG decoded groups, over chunks of KC inputs so that the groups' chunk stays in L1:
// RT rows at a time (24 accumulators), then 8 at a time, then the rest.
template <int NG, int RT = 24 / NG>
static void panel(const float* x, int64_t rows, int64_t K, const float* w, float* y, int64_t ldy, int64_t n,
                  int64_t N, const float* bias) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min(K, k0 + KC);
    int64_t r = 0;
    for (; r + RT <= rows; r += RT) micro<RT, NG>(x + r * K, K, w, K, k0, k1, y + r * ldy, ldy, n, N, bias);
    if constexpr (RT > 8)
      for (; r + 8 <= rows; r += 8) micro<8, NG>(x + r * K, K, w, K, k0, k1, y + r * ldy, ldy, n, N, bias);
    few_rows<NG>(rows - r, x + r * K, K, w, k0, k1, y + r * ldy, ldy, n, N, bias);
  }
}

// One row of x against groups [g0, g1): values converted as they are read, two groups per pass so that each
// broadcast of x serves 32 rows, block partial sums in four accumulators (their FMAs' latency hidden), then
// scaled by the block's d and its m term added.
template <int64_t KIND>
static void gemv(const float* x, const float* S, const uint8_t* w, int64_t gstride, int64_t nb, int64_t g0,
                 int64_t g1, float* y, int64_t N, const float* bias) {
  const int64_t gbb = G * block_bytes(KIND);
  for (int64_t g = g0; g < g1; g += 2) {
    const int ng = g + 1 < g1 ? 2 : 1;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + 32 * b;
      for (int j = 0; j < ng; ++j) {
        const uint8_t* gb = w + (g + j) * gstride + b * gbb;
        const uint8_t* v = gb + values_at(KIND);
        __m512 d, m;
        group_scales<KIND>(gb, d, m);
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        if constexpr (KIND == Q8_16F) {  // t0, t1: the first 16 values (scale d); t2, t3: the last 16 (d1, in m)
          for (int k = 0; k < 16; k += 2) {
            t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + k * G, true)), _mm512_set1_ps(xb[k]), t0);
            t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 1) * G, true)), _mm512_set1_ps(xb[k + 1]), t1);
            t2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 16) * G, true)), _mm512_set1_ps(xb[k + 16]),
                                 t2);
            t3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 17) * G, true)), _mm512_set1_ps(xb[k + 17]),
                                 t3);
          }
        } else if constexpr (!nibbles(KIND)) {
          for (int k = 0; k < 32; k += 4) {
            t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + k * G, true)), _mm512_set1_ps(xb[k]), t0);
            t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 1) * G, true)), _mm512_set1_ps(xb[k + 1]), t1);
            t2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 2) * G, true)), _mm512_set1_ps(xb[k + 2]), t2);
            t3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(load_bytes(v + (k + 3) * G, true)), _mm512_set1_ps(xb[k + 3]), t3);
          }
        } else {
          const __m512i nib = _mm512_set1_epi32(15);
          for (int k = 0; k < 16; k += 2) {
            const __m512i z0 = load_bytes(v + k * G, false), z1 = load_bytes(v + (k + 1) * G, false);
            t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(z0, nib)), _mm512_set1_ps(xb[k]), t0);
            t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(z0, 4)), _mm512_set1_ps(xb[k + 16]), t1);
            t2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(z1, nib)), _mm512_set1_ps(xb[k + 1]), t2);
            t3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(z1, 4)), _mm512_set1_ps(xb[k + 17]), t3);
          }
        }
        if constexpr (KIND == Q8_16F) {
          acc[j] = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), d, acc[j]);
          acc[j] = _mm512_fmadd_ps(_mm512_add_ps(t2, t3), m, acc[j]);
        } else {
          const __m512 t = _mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3));
          acc[j] = _mm512_fmadd_ps(t, d, acc[j]);
          if constexpr (has_min(KIND)) acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(S[b]), acc[j]);
        }
      }
    }
    for (int j = 0; j < ng; ++j) {
      const int64_t n0 = (g + j) * G, live = std::min<int64_t>(G, N - n0);
      const __mmask16 k = static_cast<__mmask16>(live == G ? 0xFFFF : (1u << live) - 1);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(y + n0, k, _mm512_add_ps(acc[j], bv));
    }
  }
}

// A few rows of x (2 to 8: a small decode batch) against groups [g0, g1): as gemv, one group at a time, each
// converted value multiplied into every row, two partial sums per row.
template <int64_t KIND, int RT>
static void gemv_rows(const float* x, int64_t ldx, const float* S, const uint8_t* w, int64_t gstride, int64_t nb,
                      int64_t g0, int64_t g1, float* y, int64_t ldy, int64_t N, const float* bias) {
  const int64_t gbb = G * block_bytes(KIND);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = w + g * gstride + b * gbb;
      const uint8_t* v = gb + values_at(KIND);
      __m512 d, m;
      group_scales<KIND>(gb, d, m);
      __m512 t0[RT], t1[RT];
      for (int r = 0; r < RT; ++r) t0[r] = t1[r] = _mm512_setzero_ps();
      const float* xb = x + 32 * b;
      if constexpr (KIND == Q8_16F) {  // t0: the first 16 values (scale d), t1: the last 16 (d1, in m)
        for (int k = 0; k < 16; ++k) {
          const __m512 q0 = _mm512_cvtepi32_ps(load_bytes(v + k * G, true));
          const __m512 q1 = _mm512_cvtepi32_ps(load_bytes(v + (k + 16) * G, true));
          for (int r = 0; r < RT; ++r) {
            t0[r] = _mm512_fmadd_ps(q0, _mm512_set1_ps(xb[r * ldx + k]), t0[r]);
            t1[r] = _mm512_fmadd_ps(q1, _mm512_set1_ps(xb[r * ldx + k + 16]), t1[r]);
          }
        }
      } else if constexpr (!nibbles(KIND)) {
        for (int k = 0; k < 32; k += 2) {
          const __m512 q0 = _mm512_cvtepi32_ps(load_bytes(v + k * G, true));
          const __m512 q1 = _mm512_cvtepi32_ps(load_bytes(v + (k + 1) * G, true));
          for (int r = 0; r < RT; ++r) {
            t0[r] = _mm512_fmadd_ps(q0, _mm512_set1_ps(xb[r * ldx + k]), t0[r]);
            t1[r] = _mm512_fmadd_ps(q1, _mm512_set1_ps(xb[r * ldx + k + 1]), t1[r]);
          }
        }
      } else {
        for (int k = 0; k < 16; ++k) {
          const __m512i z = load_bytes(v + k * G, false);
          const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(15)));
          const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4));
          for (int r = 0; r < RT; ++r) {
            t0[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xb[r * ldx + k]), t0[r]);
            t1[r] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xb[r * ldx + k + 16]), t1[r]);
          }
        }
      }
      for (int r = 0; r < RT; ++r) {
        if constexpr (KIND == Q8_16F) {
          acc[r] = _mm512_fmadd_ps(t0[r], d, acc[r]);
          acc[r] = _mm512_fmadd_ps(t1[r], m, acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_add_ps(t0[r], t1[r]), d, acc[r]);
          if constexpr (has_min(KIND)) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(S[r * nb + b]), acc[r]);
        }
      }
    }
    const int64_t n0 = g * G, live = std::min<int64_t>(G, N - n0);
    const __mmask16 k = static_cast<__mmask16>(live == G ? 0xFFFF : (1u << live) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < RT; ++r) _mm512_mask_storeu_ps(y + r * ldy + n0, k, _mm512_add_ps(acc[r], bv));
  }
}

template <int64_t KIND>
static void small_batch(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups, int64_t gstride,
                        int64_t N, float* y, const float* bias) {
  const int64_t nb = K / 32;
  std::vector<float> S(M * nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b)
      S[r * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + r * K + 32 * b),
                                                         _mm512_loadu_ps(x + r * K + 32 * b + 16)));
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    switch (M) {
      case 2: gemv_rows<KIND, 2>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      case 3: gemv_rows<KIND, 3>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      case 4: gemv_rows<KIND, 4>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      case 5: gemv_rows<KIND, 5>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      case 6: gemv_rows<KIND, 6>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      case 7: gemv_rows<KIND, 7>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
      default: gemv_rows<KIND, 8>(x, K, S.data(), w, gstride, nb, g0, g1, y, N, N, bias); break;
    }
  });
}
#endif

template <int64_t KIND>
static void linear_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t groups, int64_t gstride,
                        int64_t N, float* y, const float* bias) {
  const int64_t nb = K / 32;
#if defined(__AVX512F__)
  if (M == 1) {
    std::vector<float> S(nb);
    for (int64_t b = 0; b < nb; ++b)
      S[b] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + 32 * b), _mm512_loadu_ps(x + 32 * b + 16)));
    at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
      gemv<KIND>(x, S.data(), w, gstride, nb, 2 * p0, std::min(groups, 2 * p1), y, N, bias);
    });
    return;
  }
  if (M <= SMALL_BATCH) {
    small_batch<KIND>(x, M, K, w, groups, gstride, N, y, bias);
    return;
  }
#endif
  at::parallel_for(0, (groups + GP - 1) / GP, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> wbuf;  // the decoded groups, kept between calls (no allocation per call)
    if (wbuf.size() < static_cast<size_t>(GP * K * G)) wbuf.resize(GP * K * G);
    for (int64_t pass = p0; pass < p1; ++pass) {
      const int64_t g = GP * pass;
      const int ng = static_cast<int>(std::min<int64_t>(GP, groups - g));
      for (int j = 0; j < ng; ++j) {
#if defined(__AVX512F__)
        decode_group<KIND>(w + (g + j) * gstride, nb, wbuf.data() + j * K * G);
#else
        decode_group_portable<KIND>(w + (g + j) * gstride, nb, wbuf.data() + j * K * G);
#endif
      }
#if defined(__AVX512F__)
      for (int64_t p = 0; p < M; p += PANEL) {
        const int64_t rows = std::min(PANEL, M - p);
        switch (ng) {
          case 4: panel<4>(x + p * K, rows, K, wbuf.data(), y + p * N, N, g * G, N, bias); break;
          case 3: panel<3>(x + p * K, rows, K, wbuf.data(), y + p * N, N, g * G, N, bias); break;
          case 2: panel<2>(x + p * K, rows, K, wbuf.data(), y + p * N, N, g * G, N, bias); break;
          default: panel<1>(x + p * K, rows, K, wbuf.data(), y + p * N, N, g * G, N, bias); break;
        }
      }
#else
      for (int64_t r = 0; r < M; ++r)
        for (int64_t i = 0; i < ng * G; ++i) {
          const int64_t n = g * G + i;
          if (n >= N) break;
          const float* wr = wbuf.data() + (i / G) * K * G + (i % G);
          float s = 0.0f;
          for (int64_t k = 0; k < K; ++k) s += wr[k * G] * x[r * K + k];
          y[r * N + n] = s + (bias ? bias[n] : 0.0f);
        }
#endif
    }
  });
}

static void check_packed(const torch::Tensor& w, int64_t kind, int64_t K, int64_t N) {
  TORCH_CHECK(kind >= 0 && kind < KINDS, "unknown quantization kind ", kind);
  TORCH_CHECK(K > 0 && K % 32 == 0, "the input width must be a positive multiple of 32, not ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "packed weights: a contiguous uint8 [groups, bytes] tensor");
  TORCH_CHECK(w.size(1) == K / 32 * G * block_bytes(kind) && N > 0 && (N + G - 1) / G == w.size(0),
              "packed weights: ", w.size(0), " groups of ", w.size(1), " bytes do not hold ", N, " rows of width ", K);
}

// GGUF's rows of blocks [N, K / 32 * block bytes] -> groups of 16 rows [ceil(N / 16), 16 * that] (see the top).
torch::Tensor pack(const torch::Tensor& w, int64_t kind, int64_t K) {
  TORCH_CHECK(kind >= 0 && kind < KINDS, "unknown quantization kind ", kind);
  TORCH_CHECK(K > 0 && K % 32 == 0, "the input width must be a positive multiple of 32, not ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.size(1) == K / 32 * block_bytes(kind),
              "weights: uint8 rows of ", K / 32 * block_bytes(kind), " bytes for width ", K);
  const torch::Tensor src_t = w.contiguous();
  const int64_t N = w.size(0), nb = K / 32, bb = block_bytes(kind), groups = (N + G - 1) / G, gbb = G * bb;
  const int64_t ss = scale_size(kind), scales = scale_bytes(kind) / ss, vb = nibbles(kind) ? 16 : 32;
  torch::Tensor out = torch::zeros({groups, nb * gbb}, w.options());
  const uint8_t* src = src_t.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t g = n / G, i = n % G;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + n * nb * bb + b * bb;
        uint8_t* gb = dst + g * nb * gbb + b * gbb;
        for (int64_t s = 0; s < scales; ++s) std::memcpy(gb + s * ss * G + ss * i, blk + ss * s, ss);
        const uint8_t* vals = blk + ss * scales;
        for (int64_t j = 0; j < vb; ++j) gb[values_at(kind) + j * G + i] = vals[j];
      }
    }
  });
  return out;
}

// pack()'s inverse: the N rows of GGUF blocks again (to fuse weights whose rows are not whole groups).
torch::Tensor unpack(const torch::Tensor& w, int64_t kind, int64_t K, int64_t N) {
  check_packed(w, kind, K, N);
  const int64_t nb = K / 32, bb = block_bytes(kind), gbb = G * bb;
  const int64_t ss = scale_size(kind), scales = scale_bytes(kind) / ss, vb = nibbles(kind) ? 16 : 32;
  torch::Tensor out = torch::empty({N, nb * bb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / G, i = n % G;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* gb = src + g * nb * gbb + b * gbb;
      uint8_t* blk = dst + n * nb * bb + b * bb;
      for (int64_t s = 0; s < scales; ++s) std::memcpy(blk + ss * s, gb + s * ss * G + ss * i, ss);
      for (int64_t j = 0; j < vb; ++j) blk[ss * scales + j] = gb[values_at(kind) + j * G + i];
    }
  }
  return out;
}

// y [M, N] = x [M, K] @ dequant(w).T (+ bias [N]), w packed.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t kind, int64_t K, int64_t N,
                     const c10::optional<torch::Tensor>& bias) {
  check_packed(w, kind, K, N);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32,
              "input: a float32 [M, ", K, "] tensor");
  const torch::Tensor xc = x.contiguous();
  const int64_t M = x.size(0);
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
    case Q4_0: linear_impl<Q4_0>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
    case Q4_1: linear_impl<Q4_1>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
    case Q4_1F: linear_impl<Q4_1F>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
    case Q8_1F: linear_impl<Q8_1F>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
    case Q8_16F: linear_impl<Q8_16F>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
    default: linear_impl<Q8_0>(xp, M, K, wp, w.size(0), w.size(1), N, yp, bp); break;
  }
  return y;
}

// Rows ids [T] of the packed w as floats [T, K] (an embedding lookup, or the whole matrix).
torch::Tensor rows(const torch::Tensor& w, int64_t kind, int64_t K, int64_t N, const torch::Tensor& ids) {
  check_packed(w, kind, K, N);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids: int64 [T]");
  const torch::Tensor idc = ids.contiguous();
  const int64_t T = ids.size(0), nb = K / 32, gbb = G * block_bytes(kind), gstride = w.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "row ", ip[t], " outside the ", N, " rows");
  torch::Tensor out = torch::empty({T, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* g = wp + (ip[t] / G) * gstride;
      const int64_t i = ip[t] % G;
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t k = 0; k < 32; ++k) {
          float v;
          const uint8_t* gb = g + b * gbb;
          switch (kind) {
            case Q4_0: v = weight_at<Q4_0>(gb, i, k); break;
            case Q4_1: v = weight_at<Q4_1>(gb, i, k); break;
            case Q4_1F: v = weight_at<Q4_1F>(gb, i, k); break;
            case Q8_1F: v = weight_at<Q8_1F>(gb, i, k); break;
            case Q8_16F: v = weight_at<Q8_16F>(gb, i, k); break;
            default: v = weight_at<Q8_0>(gb, i, k); break;
          }
          op[t * K + b * 32 + k] = v;
        }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "GGUF rows of blocks as the groups of 16 rows linear() reads", py::arg("w"), py::arg("kind"),
        py::arg("K"));
  m.def("unpack", &unpack, "pack()'s inverse", py::arg("w"), py::arg("kind"), py::arg("K"), py::arg("N"));
  m.def("linear", &linear, "y = x @ dequant(w).T + bias over packed GGUF blocks", py::arg("x"), py::arg("w"),
        py::arg("kind"), py::arg("K"), py::arg("N"), py::arg("bias") = py::none());
  m.def("rows", &rows, "float32 rows of packed GGUF blocks", py::arg("w"), py::arg("kind"), py::arg("K"),
        py::arg("N"), py::arg("ids"));
}
