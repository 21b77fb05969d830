// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy). Parallel over sequences; each task walks its sequence's
// slots in order, so every slot's K (then V) row of all KV heads is one contiguous read.
// The pool is float32 or bfloat16 (T); the query, the scores and every sum are float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

using bf16 = at::BFloat16;

static inline float f32(float x) { return x; }
static inline float f32(bf16 x) {  // bfloat16 is the top half of a float32
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
static inline float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * f32(b[i]);
  return s;
}

// Blocks sit anywhere in the pool, so the hardware prefetcher restarts at every block boundary: ask
// for the next block's rows (n_elems elements of T) while this one is being read.
template <typename T>
static inline void prefetch_block(const T* base, int64_t n_elems) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const char* p = reinterpret_cast<const char*>(base);
  for (int64_t i = 0; i < n_elems * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
#endif
}

// Scores of one query head against n consecutive key rows (row stride `row` elements) of one block.
// AVX-512, D a multiple of 16: one accumulator per row, so the n dot products run side by side
// instead of each waiting on its own chain of adds (the plain loop below is latency-bound, not
// memory-bound: it read KV at 14-17 GB/s where a plain sum of the same pool reads 86-120). A full
// group of 16 rows has its count fixed at compile time, so the 16 accumulators stay in registers (with
// a run-time count they lived on the stack: a load and a store around every FMA).
#if defined(__AVX512F__)
template <int N, typename T>
static inline void scores_avx512(const float* q, const T* k, int64_t row, int64_t D, float sc, float* out) {
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(qv, load16(k + j * row + d), acc[j]);
  }
  for (int j = 0; j < N; ++j) out[j] = _mm512_reduce_add_ps(acc[j]) * sc;
}
#endif

template <typename T>
static inline void block_scores(const float* q, const T* k, int64_t row, int64_t n, int64_t D, float sc,
                                float* out) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    if (n == 16) return scores_avx512<16, T>(q, k, row, D, sc, out);
    if (n >= 8) {
      scores_avx512<8, T>(q, k, row, D, sc, out);
      k += 8 * row, out += 8, n -= 8;
    }
    for (; n >= 4; n -= 4, k += 4 * row, out += 4) scores_avx512<4, T>(q, k, row, D, sc, out);
    for (; n >= 1; n -= 1, k += row, out += 1) scores_avx512<1, T>(q, k, row, D, sc, out);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, k + j * row, D) * sc;
}

#if defined(__AVX512F__)
// acc[h * D + d] = sum over slots l of scores[h * L + l] * V[l, g, d], for the NH heads h0.. of KV head g,
// D a multiple of 64: the NH x 4 accumulators stay in registers and each V row is loaded once for all of
// them (a loop over heads inside the slot loop kept them in memory: a load and a store per FMA).
template <int NH, typename T>
static void values_avx512(const T* vp, const int64_t* table, int64_t block_size, int64_t row, int64_t L,
                          const float* scores, int64_t h0, int64_t g, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[NH][4];
    for (int i = 0; i < NH; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_setzero_ps();
    for (int64_t l0 = 0; l0 < L; l0 += block_size) {
      const T* vblock = vp + table[l0 / block_size] * block_size * row + g * D + d0;
      const int64_t n = std::min(block_size, L - l0);
      if (l0 + block_size < L) prefetch_block(vp + table[l0 / block_size + 1] * block_size * row, block_size * row);
      for (int64_t j = 0; j < n; ++j) {
        const T* v = vblock + j * row;
        __m512 vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = load16(v + 16 * c);
        for (int i = 0; i < NH; ++i) {
          const __m512 p = _mm512_set1_ps(scores[(h0 + i) * L + l0 + j]);
          for (int c = 0; c < 4; ++c) a[i][c] = _mm512_fmadd_ps(p, vv[c], a[i][c]);
        }
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (h0 + i) * D + d0 + 16 * c, a[i][c]);
  }
}
#endif

// acc[h * D + d] = sum over slots of scores[h * L + l] * V[l, h / G, d], every head.
template <typename T>
static void weighted_values(const T* vp, const int64_t* table, int64_t block_size, int64_t row, int64_t L,
                            const float* scores, int64_t H, int64_t G, int64_t D, float* acc) {
#if defined(__AVX512F__)
  if (D % 64 == 0) {
    for (int64_t g = 0; g < H / G; ++g) {
      for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
        switch (std::min<int64_t>(4, (g + 1) * G - h0)) {
          case 1: values_avx512<1, T>(vp, table, block_size, row, L, scores, h0, g, D, acc); break;
          case 2: values_avx512<2, T>(vp, table, block_size, row, L, scores, h0, g, D, acc); break;
          case 3: values_avx512<3, T>(vp, table, block_size, row, L, scores, h0, g, D, acc); break;
          default: values_avx512<4, T>(vp, table, block_size, row, L, scores, h0, g, D, acc); break;
        }
      }
    }
    return;
  }
#endif
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t l = 0; l < L; ++l) {
    const T* vrow = vp + (table[l / block_size] * block_size + l % block_size) * row;
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * L + l];
      const T* v = vrow + (h / G) * D;
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += p * f32(v[i]);
    }
  }
}

// q: [B, H, D] float32; k_pool, v_pool: [slots, KVH, D] of T; tables: [B, max_blocks] int64; lens: [B] int64.
template <typename T>
static void paged_decode_impl(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale,
                              torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), G = H / KVH;
  const int64_t max_blocks = tables.size(1), row = KVH * D;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D);
    std::vector<float> mx(H), sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lp[b];
      const int64_t* table = tp + b * max_blocks;
      const float* qb = qp + b * H * D;
      scores.resize(H * L);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t l0 = 0; l0 < L; l0 += block_size) {  // one KV block: its slots are consecutive rows
        const int64_t n = std::min(block_size, L - l0);
        const T* kblock = kp + table[l0 / block_size] * block_size * row;
        if (l0 + block_size < L) prefetch_block(kp + table[l0 / block_size + 1] * block_size * row, block_size * row);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t m = std::min<int64_t>(16, n - j0);
            block_scores(qb + h * D, kblock + j0 * row + (h / G) * D, row, m, D, sc, &scores[h * L + l0 + j0]);
          }
          for (int64_t j = 0; j < n; ++j) mx[h] = std::max(mx[h], scores[h * L + l0 + j]);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * L;
        const float m = mx[h];
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t l = 0; l < L; ++l) { sh[l] = std::exp(sh[l] - m); total += sh[l]; }
        sum[h] = total;
      }
      weighted_values(vp, table, block_size, row, L, scores.data(), H, G, D, acc.data());
      for (int64_t h = 0; h < H; ++h) {
        float* o = op + (b * H + h) * D;
        const float inv = 1.f / sum[h];
        for (int64_t i = 0; i < D; ++i) o[i] = acc[h * D + i] * inv;
      }
    }
  });
}

// The result is float32 [B, H, D], whatever the pool's type (float32 or bfloat16, K and V alike).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "the query must be float32");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of different types");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous());
  auto out = torch::empty_like(q);
  if (k_pool.scalar_type() == torch::kFloat32) {
    paged_decode_impl<float>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "KV pool must be float32 or bfloat16");
    paged_decode_impl<bf16>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32 or bfloat16 pool)");
}
