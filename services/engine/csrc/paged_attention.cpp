// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy). Parallel over sequences. On AVX-512 with a head size that is a
// multiple of 64, one pass over the sequence (online softmax, as FlashAttention and vLLM's CPU kernel do):
// each run of up to 16 consecutive slots has its K rows scored and its V rows summed while both are in L1,
// and the next run is prefetched meanwhile. Elsewhere two plain passes (scores, then values).
// The pool is float32 or bfloat16 (T); the query, the scores and every sum are float32.
// paged_prefill (further down) is the prompts' counterpart: AMX tiles in bfloat16, AVX-512 FMAs in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "avx512_math.h"

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

// Everything one task needs for one sequence: the pool, the sequence's block table and length, its query
// ([H, D] float32) and its output row.
template <typename T>
struct Seq {
  const T *k, *v;
  const int64_t* table;
  int64_t L, block_size, H, G, D, row;  // row = KVH * D: the elements of one slot
  float scale;
  const float* q;
  float* out;
  const T* slot_k(int64_t l) const { return k + (table[l / block_size] * block_size + l % block_size) * row; }
  const T* slot_v(int64_t l) const { return v + (table[l / block_size] * block_size + l % block_size) * row; }
};

// Two plain passes: every head's scores, then the softmax-weighted sum of the values.
template <typename T>
static void plain_sequence(const Seq<T>& s, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t H = s.H, D = s.D, L = s.L;
  scores.resize(H * L);
  acc.assign(H * D, 0.f);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t h = 0; h < H; ++h) scores[h * L + l] = dot(s.q + h * D, s.slot_k(l) + (h / s.G) * D, D) * s.scale;
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores.data() + h * L;
    float m = sh[0], total = 0.f;
    for (int64_t l = 1; l < L; ++l) m = std::max(m, sh[l]);
    for (int64_t l = 0; l < L; ++l) { sh[l] = std::exp(sh[l] - m); total += sh[l]; }
    for (int64_t l = 0; l < L; ++l) {
      const T* v = s.slot_v(l) + (h / s.G) * D;
      float* a = acc.data() + h * D;
      const float p = sh[l] / total;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += p * f32(v[i]);
    }
  }
  std::copy(acc.begin(), acc.end(), s.out);
}

#if defined(__AVX512F__)
// Lane j of the result is the sum of v[j]'s 16 lanes: a tree of 15 adds and 30 shuffles, where 16 separate
// _mm512_reduce_add_ps cost about three times as many instructions.
__attribute__((always_inline)) static inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  // per 128-bit lane, t[i] = [a, b, a', b']: partial sums of rows 2i (a) and 2i + 1 (b)
  for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                                   _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // per lane, u[i] = rows 4i .. 4i + 3
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // lanes 0 and 2 of u[2i] plus lanes 1 and 3, then the same one level up: rows 0..15 in order
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Row j of the n (<= 16) rows from k (stride `row` elements); past the last, the last again (its lane is
// masked off), so a run that ends mid-block reads nothing outside the rows it owns.
template <bool Full, typename T>
static inline const T* row_at(const T* k, int64_t row, int j, int64_t n) {
  return k + (Full ? j : std::min<int64_t>(j, n - 1)) * row;
}

// Dot products of one query head with 16 key rows, DV vectors of 16 (D = 16 DV): the query in DV registers,
// one accumulator per row, rows in turn (one pointer stepping by `row`), 16 independent chains for the
// out-of-order core to overlap, then summed by hsum16. Every count is fixed at compile time, so nothing
// leaves the registers (with a run-time D the accumulators and the row pointers were spilled).
template <int DV, bool Full, typename T>
static inline __m512 dots16(const float* q, const T* k, int64_t row, int64_t n) {
  __m512 qv[DV], acc[16];
  for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < 16; ++j) {
    const T* r = row_at<Full>(k, row, j, n);
    acc[j] = _mm512_mul_ps(qv[0], load16(r));
    for (int c = 1; c < DV; ++c) acc[j] = _mm512_fmadd_ps(qv[c], load16(r + 16 * c), acc[j]);
  }
  return hsum16(acc);
}

// The same over a bfloat16 pool with AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4): the query rounded to
// bfloat16 (exact, as the model's query is bfloat16) and one vdpbf16ps per 32 elements, which multiplies the
// pairs exactly and sums them in float32, where the plain path widens every key element and runs two FMAs.
// Compiled for that ISA alone and called only where the CPU has it (has_bf16_dot).
template <int DV, bool Full>
__attribute__((target("avx512bf16,avx512bw,avx512f")))
static __m512 dots16_dpbf16(const bf16* q, const bf16* k, int64_t row, int64_t n) {
  static_assert(DV % 2 == 0, "pairs of 16");
  __m512bh qv[DV / 2];
  __m512 acc[16];
  for (int c = 0; c < DV / 2; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int j = 0; j < 16; ++j) {
    const bf16* r = row_at<Full>(k, row, j, n);
    acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < DV / 2; ++c) acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(r + 32 * c));
  }
  return hsum16(acc);
}

static bool has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Dot products of one query head (q, and qh: the same rounded to T) with n (<= 16) consecutive key rows.
template <int DV, typename T>
static inline __m512 dots(const float* q, const T* qh, const T* k, int64_t row, int64_t n) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (has_bf16_dot()) return n == 16 ? dots16_dpbf16<DV, true>(qh, k, row, n) : dots16_dpbf16<DV, false>(qh, k, row, n);
  }
  return n == 16 ? dots16<DV, true, T>(q, k, row, n) : dots16<DV, false, T>(q, k, row, n);
}

// acc[i * D + d] = alpha[i] * acc[i * D + d] + sum over rows j < n of p[i * 16 + j] * V[j, d], for NH heads
// sharing the value rows from v (stride `row`), D a multiple of 64: NH x 4 accumulators in registers and
// each value row loaded once for all of them.
template <int NH, typename T>
static inline void values(const T* v, int64_t row, int64_t n, const float* p, const float* alpha, float* acc,
                          int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[NH][4];
    for (int i = 0; i < NH; ++i) {
      const __m512 al = _mm512_set1_ps(alpha[i]);
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + i * D + d0 + 16 * c));
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = load16(v + j * row + d0 + 16 * c);
      for (int i = 0; i < NH; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i * 16 + j]);
        for (int c = 0; c < 4; ++c) a[i][c] = _mm512_fmadd_ps(pj, vv[c], a[i][c]);
      }
    }
    for (int i = 0; i < NH; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + i * D + d0 + 16 * c, a[i][c]);
  }
}

static inline __m512 exp16(__m512 x) {  // libmvec's 16-lane expf (GCC vectorizes this loop into one call)
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
#pragma omp simd
  for (int i = 0; i < 16; ++i) t[i] = std::exp(t[i]);
  return _mm512_load_ps(t);
}

// Ask for n rows of `bytes` each, `row_bytes` apart, to be brought into L1. Blocks sit anywhere in the pool, so
// the hardware prefetcher would restart at every block.
static inline void prefetch_rows(const void* base, int64_t n, int64_t row_bytes, int64_t bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + j * row_bytes + i, _MM_HINT_T0);
}

// One pass over the sequence in runs of up to 16 slots (never crossing a block): each run's scores, a running
// maximum and sum per head (online softmax: earlier sums are rescaled when the maximum grows), and the run's
// values weighted at once, while its rows are in L1.
// D = 16 DV, a multiple of 64.
template <int DV, typename T>
static void flash_sequence(const Seq<T>& s, std::vector<float>& acc, std::vector<float>& buf, const T* qh) {
  const int64_t H = s.H, G = s.G, D = s.D, KVH = H / G, row = s.row, bs = s.block_size;
  acc.assign(H * D, 0.f);
  buf.assign(H * 16 + 3 * H, 0.f);
  float* p = buf.data();          // [H, 16]: this run's weights
  float* alpha = p + H * 16;      // [H]: the rescale of earlier sums
  float* mx = alpha + H;          // [H]: running maximum
  float* total = mx + H;          // [H]: running sum of weights
  std::fill(mx, mx + H, -1e30f);  // finite: -ffast-math assumes no infinities
  for (int64_t l0 = 0; l0 < s.L;) {
    const int64_t n = std::min<int64_t>({16, bs - l0 % bs, s.L - l0});
    const T* k = s.slot_k(l0);
    const T* v = s.slot_v(l0);
    // the next run, prefetched one KV head at a time (measured: 1.16x on a bfloat16 pool; two runs ahead, or into
    // L2 only, did no better, and a float32 pool is bound by bandwidth either way)
    const int64_t l1 = l0 + n, n1 = l1 < s.L ? std::min<int64_t>({16, bs - l1 % bs, s.L - l1}) : 0;
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t g = 0; g < KVH; ++g) {
      if (n1) prefetch_rows(s.slot_k(l1) + g * D, n1, row * sizeof(T), D * sizeof(T));
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        __m512 sc = _mm512_mul_ps(dots<DV>(s.q + h * D, qh + h * D, k + g * D, row, n), _mm512_set1_ps(s.scale));
        sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), sc);
        const float m = std::max(mx[h], _mm512_reduce_max_ps(sc));
        const __m512 w = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
        alpha[h] = std::exp(mx[h] - m);
        total[h] = total[h] * alpha[h] + _mm512_reduce_add_ps(w);
        mx[h] = m;
        _mm512_storeu_ps(p + h * 16, w);
      }
    }
    for (int64_t g = 0; g < KVH; ++g) {
      if (n1) prefetch_rows(s.slot_v(l1) + g * D, n1, row * sizeof(T), D * sizeof(T));
      for (int64_t h0 = g * G; h0 < (g + 1) * G; h0 += 4) {
        const T* vg = v + g * D;
        float *ph = p + h0 * 16, *al = alpha + h0, *a = acc.data() + h0 * D;
        switch (std::min<int64_t>(4, (g + 1) * G - h0)) {
          case 1: values<1, T>(vg, row, n, ph, al, a, D); break;
          case 2: values<2, T>(vg, row, n, ph, al, a, D); break;
          case 3: values<3, T>(vg, row, n, ph, al, a, D); break;
          default: values<4, T>(vg, row, n, ph, al, a, D); break;
        }
      }
    }
    l0 = l1;
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / total[h];
    for (int64_t i = 0; i < D; ++i) s.out[h * D + i] = acc[h * D + i] * inv;
  }
}
#endif

// q: [B, H, D] float32 or bfloat16, rows any stride apart; k_pool, v_pool: [slots, KVH, D] of T; tables:
// [B, max_blocks] int64; lens: [B] int64; out: [B, H * D] contiguous, of q's type.
template <typename T, typename Q>
static void paged_decode_impl(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale,
                              torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), G = H / KVH;
  const int64_t max_blocks = tables.size(1), q_row = q.stride(0);
  const Q* qp = q.data_ptr<Q>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  Q* op = out.data_ptr<Q>();
  Seq<T> proto{k_pool.data_ptr<T>(), v_pool.data_ptr<T>(), nullptr, 0, block_size, H, G, D, KVH * D,
               static_cast<float>(scale), nullptr, nullptr};
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc, buf;
    std::vector<T> qh(std::is_same_v<T, bf16> ? H * D : 0);  // the query rounded to bfloat16, for vdpbf16ps
    // the query widened to float32 and the output before it is rounded to Q (unused where Q is float32)
    std::vector<float> q32(std::is_same_v<Q, float> ? 0 : H * D), o32(std::is_same_v<Q, float> ? 0 : H * D);
    for (int64_t b = begin; b < end; ++b) {
      Seq<T> s = proto;
      const Q* qb = qp + b * q_row;
      s.table = tp + b * max_blocks, s.L = lp[b];
      if constexpr (std::is_same_v<Q, float>) {
        s.q = qb, s.out = op + b * H * D;
      } else {
        for (int64_t i = 0; i < H * D; ++i) q32[i] = f32(qb[i]);
        s.q = q32.data(), s.out = o32.data();
      }
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {  // the head sizes of the models served (a fixed D keeps the dots in registers)
        const T* qr;  // the query in T: read only by the bfloat16 dot products
        if constexpr (std::is_same_v<T, bf16> && std::is_same_v<Q, bf16>) {
          qr = qb;  // a bfloat16 query is its own rounding
        } else if constexpr (std::is_same_v<T, bf16>) {
          if (has_bf16_dot())
            for (int64_t i = 0; i < H * D; ++i) qh[i] = static_cast<T>(s.q[i]);
          qr = qh.data();
        } else {
          qr = s.q;
        }
        D == 64 ? flash_sequence<4>(s, acc, buf, qr) : flash_sequence<8>(s, acc, buf, qr);
      } else {
        plain_sequence(s, buf, acc);
      }
#else
      plain_sequence(s, buf, acc);
#endif
      if constexpr (!std::is_same_v<Q, float>)
        for (int64_t i = 0; i < H * D; ++i) op[b * H * D + i] = static_cast<Q>(o32[i]);
    }
  });
}

template <typename T>
static void paged_decode_pool(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                              const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale,
                              torch::Tensor& out) {
  if (q.scalar_type() == torch::kFloat32)
    paged_decode_impl<T, float>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  else
    paged_decode_impl<T, bf16>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
}

// The result is [B, H * D] in the query's type (float32 or bfloat16), whatever the pool's type (float32 or
// bfloat16, K and V alike); every sum is float32. The query's rows may lie any stride apart (a view of the fused
// qkv projection), each row's heads contiguous.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "the query must be float32 or bfloat16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row's heads contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools of different types");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous() && lens.is_contiguous());
  auto out = torch::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (k_pool.scalar_type() == torch::kFloat32) {
    paged_decode_pool<float>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == torch::kBFloat16, "KV pool must be float32 or bfloat16");
    paged_decode_pool<bf16>(q, k_pool, v_pool, tables, lens, block_size, scale, out);
  }
  return out;
}

// k_pool[slots[t]] = k[t] and v_pool[slots[t]] = v[t] for every new token t: k, v [T, KVH, D] with each row
// contiguous (rows any stride apart: views of the fused qkv projection), pools [slots, KVH, D] of the same type.
// One pass for both, where two index_copy_ calls cost ~4x as long on a 2,048-token prefill chunk.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == slots.numel());
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type());
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2));
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && slots.is_contiguous() &&
              slots.scalar_type() == torch::kInt64);
  TORCH_CHECK(k_pool.size(1) * k_pool.size(2) == k.size(1) * k.size(2));
  const int64_t T = k.size(0), slot_count = k_pool.size(0);
  const int64_t bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < slot_count, "slot out of range");
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kd = static_cast<char*>(k_pool.data_ptr()), *vd = static_cast<char*>(v_pool.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kd + sp[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vd + sp[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Prompt attention on AMX tiles (bfloat16 pool and query, head size 64): every prefill chunk of a step, whether it
// starts its sequence or continues one, attends causally to its sequence's keys read from the pool through the
// block table. Per sequence and KV head the keys and values are first repacked into the tiles' pair-interleaved
// layout (once, shared by the G query heads and every block of queries); then each block of 16 queries of one head
// scores its keys on the tiles (two 16 x 32 by 32 x 16 products per 16 keys), takes a softmax over whole rows in
// AVX-512 (the scores of 16 rows fit in L2 for any context here, so no online rescaling), rounds the weights to
// bfloat16 and sums the values on four accumulator tiles (16 x 64 float32). As FlashAttention's bfloat16 path
// does, the weights are rounded to bfloat16 before the value product; every sum is float32.
#if defined(__AVX512F__)
#include <atomic>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

// The CPU has AMX (tiles and bfloat16 products) and Linux grants this process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 and later; oneDNN asks the same way). Asked once.
static bool amx_ready() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16_tile = d & (1u << 22);
    if (!tile || !bf16_tile || !has_bf16_dot()) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return yes;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One sequence's prefill chunk: n queries from flat row `start`, after `computed` tokens already cached.
struct Chunk {
  int64_t start, n, computed, packed;  // packed: offset of its repacked K (and V) in the step's buffers
  const int64_t* table;
  int64_t keys() const { return computed + n; }
  int64_t padded() const { return (keys() + 31) / 32 * 32; }
};

// A block's 16 query rows of head h (64 elements each) into qb, rows past the chunk's end zero.
template <typename T>
static void fill_queries(const T* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, int64_t rows, T* qb) {
  for (int64_t r = 0; r < 16; ++r) {
    if (r < rows)
      std::memcpy(qb + r * 64, q + (c.start + q0 + r) * q_row + h * 64, 64 * sizeof(T));
    else
      std::memset(qb + r * 64, 0, 64 * sizeof(T));
  }
}

// K rows of one KV head into B tiles of 16 keys: two tiles per 16 keys (pairs of elements 0-31, 32-63), each row
// of a tile one pair-index, 16 keys x 2 elements (64 bytes). V rows into B tiles of 32 keys: four per 32 keys
// (elements 16 at a time), each row a pair of consecutive keys, 16 elements x 2 keys. Keys past the end are zero.
__attribute__((target("avx512bw,avx512f")))
static void pack_kv(const bf16* k_pool, const bf16* v_pool, const Chunk& c, int64_t g, int64_t block_size,
                    int64_t row, bf16* kp, bf16* vp) {
  const int64_t L = c.keys(), Lp = c.padded();
  std::memset(kp + L / 16 * 1024, 0, (Lp * 64 - L / 16 * 1024) * sizeof(bf16));  // the blocks keys past L fall in
  std::memset(vp + L / 32 * 2048, 0, (Lp * 64 - L / 32 * 2048) * sizeof(bf16));
  // key j's row in the pool, block by block (no division per key); the vectors are kept per thread
  thread_local std::vector<const bf16*> krow, vrow;
  krow.resize(L + 1);
  vrow.resize(L + 1);
  for (int64_t b = 0, j = 0; j < L; ++b)
    for (int64_t i = 0, base = c.table[b] * block_size; i < block_size && j < L; ++i, ++j)
      krow[j] = k_pool + (base + i) * row + g * 64, vrow[j] = v_pool + (base + i) * row + g * 64;
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t j = 0; j < L; ++j) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(krow[j]);
    uint32_t* kt = kp32 + (j / 16) * 512 + (j % 16);  // + (pair / 16) * 256 + (pair % 16) * 16
    for (int p = 0; p < 32; ++p) kt[(p / 16) * 256 + (p % 16) * 16] = kr[p];
  }
  // two keys' rows, 16 elements at a time, interleaved element by element: one 64-byte tile row
  alignas(64) static const uint16_t zip[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(zip);
  for (int64_t j = 0; j < L; j += 2) {
    const bf16* a = vrow[j];
    const bf16* b = j + 1 < L ? vrow[j + 1] : nullptr;
    bf16* vt = vp + (j / 32) * 2048 + ((j % 32) / 2) * 32;
    for (int db = 0; db < 4; ++db) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + db * 16));
      const __m256i y = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + db * 16)) : _mm256_setzero_si256();
      const __m512i xy = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
      _mm512_storeu_si512(vt + db * 512, _mm512_permutexvar_epi16(order, xy));
    }
  }
}

// Weights as the value product reads them: float32 as they are, bfloat16 rounded to nearest even by vcvtneps2bf16.
// softmax_rows below is compiled with AVX512_BF16 allowed for both types, so that this inlines; its float32 form
// has no bfloat16 conversion in it (no such instruction is emitted) and runs on any AVX-512 CPU.
__attribute__((target("avx512bf16,avx512bw,avx512f"), always_inline))
static inline void store_weights(float* p, __m512 w) { _mm512_storeu_ps(p, w); }
__attribute__((target("avx512bf16,avx512bw,avx512f"), always_inline))
static inline void store_weights(bf16* p, __m512 w) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(w));
}

// softmax(scale * scores) of 16 rows of s ([16, width] float32) into p ([16, width]): row r sees keys
// 0 .. seen0 + r - 1 (rows from `rows` on are padding: all zero). Its maximum, then exp(scale * (s - max)), summed
// unrounded into inv[r] = 1 / sum. Only the last 16 keys a row sees can be partly masked.
template <typename P>
__attribute__((target("avx512bf16,avx512bw,avx512f")))
static void softmax_rows(const float* s, P* p, int64_t width, int64_t rows, int64_t seen0, float scale, float* inv) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < 16; ++r) {
    const float* sr = s + r * width;
    P* pr = p + r * width;
    if (r >= rows) {
      std::memset(pr, 0, width * sizeof(P));
      continue;
    }
    const int64_t seen = seen0 + r;
    const int64_t full = seen / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (seen - full)) - 1);
    __m512 m = _mm512_set1_ps(-1e30f);
    for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + j));
    if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_loadu_ps(sr + full));
    const __m512 shift = _mm512_set1_ps(-scale * _mm512_reduce_max_ps(m));
    __m512 total = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < full; j += 16) {
      const __m512 w = avx512::exp(_mm512_fmadd_ps(_mm512_loadu_ps(sr + j), sc, shift));
      total = _mm512_add_ps(total, w);
      store_weights(pr + j, w);
    }
    if (tail) {  // the partly masked run
      const __m512 w = _mm512_maskz_mov_ps(tail, avx512::exp(_mm512_fmadd_ps(_mm512_loadu_ps(sr + j), sc, shift)));
      total = _mm512_add_ps(total, w);
      store_weights(pr + j, w);
      j += 16;
    }
    std::memset(pr + j, 0, (width - j) * sizeof(P));  // runs wholly past the row's last key
    inv[r] = 1.f / _mm512_reduce_add_ps(total);
  }
}

// One block of up to 16 queries of head h: rows q0 .. q0 + rows - 1 of the chunk. s: [16, Lp] float32 scores,
// p: [16, Lp] bfloat16 weights, qb: [16, 64] bfloat16, o: [16, 64] float32 (scratch).
__attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512bw,avx512f")))
static void prefill_block(const bf16* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, const bf16* kp,
                          const bf16* vp, float scale, bf16* out, int64_t out_row, float* s, bf16* p, bf16* qb,
                          float* o) {
  const int64_t rows = std::min<int64_t>(16, c.n - q0);
  const int64_t limit = c.computed + q0 + rows;  // keys the block's last query sees
  const int64_t chunks = (limit + 31) / 32, width = chunks * 32;  // keys scored, in 32s
  fill_queries(q, q_row, c, h, q0, rows, qb);
  _tile_loadd(0, qb, 128);       // queries, elements 0-31
  _tile_loadd(1, qb + 32, 128);  // queries, elements 32-63
  for (int64_t kb = 0; kb < 2 * chunks; ++kb) {
    _tile_zero(4);
    _tile_loadd(2, kp + kb * 1024, 64);
    _tile_loadd(3, kp + kb * 1024 + 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, s + kb * 16, width * sizeof(float));
  }
  float inv[16];
  softmax_rows(s, p, width, rows, c.computed + q0 + 1, scale, inv);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const bf16* vt = vp + kc * 2048;
    _tile_loadd(0, p + kc * 32, width * sizeof(bf16));
    _tile_loadd(1, vt, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, vt + 512, 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, vt + 1024, 64);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, vt + 1536, 64);
    _tile_dpbf16ps(7, 0, 1);
  }
  _tile_stored(4, o, 256);
  _tile_stored(5, o + 16, 256);
  _tile_stored(6, o + 32, 256);
  _tile_stored(7, o + 48, 256);
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = out + (c.start + q0 + r) * out_row + h * 64;
    const __m512 iv = _mm512_set1_ps(inv[r]);
    for (int d = 0; d < 64; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * 64 + d), iv)));
  }
}

// The float32 prompt kernel: the same blocks of 16 queries on AVX-512 FMAs (no AMX for float32). Keys are repacked
// transposed, 16 at a time (kt: [L / 16][64][16]: a vector holds one element of 16 keys), so a block's scores are
// 16 accumulators, each element of the head one vector load and 16 FMAs with the queries' elements broadcast;
// values are copied into rows in key order (vr: [L][64]) and summed 4 query rows x 64 elements at a time.
static void pack_kv_f32(const float* k_pool, const float* v_pool, const Chunk& c, int64_t g, int64_t block_size,
                        int64_t row, float* kt, float* vr) {
  const int64_t L = c.keys(), Lp = c.padded();
  std::memset(kt + L / 16 * 1024, 0, (Lp * 64 - L / 16 * 1024) * sizeof(float));
  std::memset(vr + L * 64, 0, (Lp - L) * 64 * sizeof(float));
  for (int64_t b = 0, j = 0; j < L; ++b)
    for (int64_t i = 0, base = c.table[b] * block_size; i < block_size && j < L; ++i, ++j) {
      const float* k = k_pool + (base + i) * row + g * 64;
      float* t = kt + (j / 16) * 1024 + (j % 16);
      for (int d = 0; d < 64; ++d) t[d * 16] = k[d];
      std::memcpy(vr + j * 64, v_pool + (base + i) * row + g * 64, 64 * sizeof(float));
    }
}

static void prefill_block_f32(const float* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, const float* kt,
                              const float* vr, float scale, float* out, int64_t out_row, float* s, float* p,
                              float* qb) {
  const int64_t rows = std::min<int64_t>(16, c.n - q0);
  const int64_t limit = c.computed + q0 + rows;
  const int64_t blocks = (limit + 15) / 16, width = blocks * 16;
  fill_queries(q, q_row, c, h, q0, rows, qb);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const float* k = kt + kb * 1024;
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < 64; ++d) {
      const __m512 kv = _mm512_loadu_ps(k + d * 16);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qb[r * 64 + d]), kv, acc[r]);
    }
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(s + r * width + kb * 16, acc[r]);
  }
  float inv[16];
  softmax_rows(s, p, width, rows, c.computed + q0 + 1, scale, inv);
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) acc[i][e] = _mm512_setzero_ps();
    const int64_t seen = c.computed + q0 + std::min<int64_t>(r0 + 4, rows);  // keys the group's last row sees
    for (int64_t j = 0; j < seen; ++j) {
      __m512 v[4];
      for (int e = 0; e < 4; ++e) v[e] = _mm512_loadu_ps(vr + j * 64 + 16 * e);
      for (int i = 0; i < 4; ++i) {
        const __m512 w = _mm512_set1_ps(p[(r0 + i) * width + j]);
        for (int e = 0; e < 4; ++e) acc[i][e] = _mm512_fmadd_ps(w, v[e], acc[i][e]);
      }
    }
    for (int i = 0; i < 4 && r0 + i < rows; ++i) {
      float* dst = out + (c.start + q0 + r0 + i) * out_row + h * 64;
      const __m512 iv = _mm512_set1_ps(inv[r0 + i]);
      for (int e = 0; e < 4; ++e) _mm512_storeu_ps(dst + 16 * e, _mm512_mul_ps(acc[i][e], iv));
    }
  }
}

__attribute__((target("amx-tile,amx-bf16")))
static void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 drops the stores above as dead without this
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile")))
static void release_tiles() { _tile_release(); }
#endif

// Whether paged_prefill runs here for that pool type: float32 on any AVX-512 build; bfloat16 where AMX is granted.
bool prefill_ready(bool bfloat16) {
#if defined(__AVX512F__)
  return !bfloat16 || amx_ready();
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// The chunks' keys and values repacked (one task per chunk and KV head), then the blocks of 16 queries with all their
// heads, costliest first, taken in turn by whichever thread is free. Scratch stays with its thread between calls (a
// step's layers all need about the same): no allocation, page faults or zeroing per call.
template <typename T>
static void prefill_impl(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                         const std::vector<Chunk>& chunks, int64_t packed, int64_t widest, int64_t block_size,
                         float scale, torch::Tensor& out) {
  const int64_t S = chunks.size(), H = q.size(1), KVH = k_pool.size(1), G = H / KVH;
  static thread_local std::vector<T> kp, vp;
  if (static_cast<int64_t>(kp.size()) < packed) kp.resize(packed), vp.resize(packed);
  T *kpd = kp.data(), *vpd = vp.data();  // (inside the parallel regions kp names each thread's own)
  const T *kpool = k_pool.data_ptr<T>(), *vpool = v_pool.data_ptr<T>(), *qp = q.data_ptr<T>();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i / KVH];
      const int64_t g = i % KVH, at = c.packed + g * c.padded() * 64;
      if constexpr (std::is_same_v<T, bf16>)
        pack_kv(kpool, vpool, c, g, block_size, KVH * 64, kpd + at, vpd + at);
      else
        pack_kv_f32(kpool, vpool, c, g, block_size, KVH * 64, kpd + at, vpd + at);
    }
  });
  struct Item { int64_t chunk, q0, cost; };
  std::vector<Item> items;
  for (int64_t i = 0; i < S; ++i)
    for (int64_t q0 = 0; q0 < chunks[i].n; q0 += 16) items.push_back({i, q0, chunks[i].computed + q0 + 16});
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  T* op = out.data_ptr<T>();
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    static thread_local std::vector<float> s, o(16 * 64);
    static thread_local std::vector<T> p, qb(16 * 64);
    if (static_cast<int64_t>(s.size()) < 16 * widest) s.resize(16 * widest), p.resize(16 * widest);
    if constexpr (std::is_same_v<T, bf16>) load_tiles();
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Chunk& c = chunks[items[i].chunk];
      for (int64_t h = 0; h < H; ++h) {
        const int64_t at = c.packed + (h / G) * c.padded() * 64;
        if constexpr (std::is_same_v<T, bf16>)
          prefill_block(qp, q.stride(0), c, h, items[i].q0, kpd + at, vpd + at, scale, op, H * 64, s.data(),
                        p.data(), qb.data(), o.data());
        else
          prefill_block_f32(qp, q.stride(0), c, h, items[i].q0, kpd + at, vpd + at, scale, op, H * 64, s.data(),
                            p.data(), qb.data());
      }
    }
    if constexpr (std::is_same_v<T, bf16>) release_tiles();
  });
}
#endif

// out[rows of each chunk] = causal attention of the chunk's queries over its sequence's keys in the pool.
// q: [T, H, 64] float32 or bfloat16, rows any stride apart (a view of the fused qkv projection); pools
// [slots, KVH, 64] and out [T, H * 64] (contiguous) of the same type; starts, num_new, computed: [S] int64 (flat row
// of each chunk's first query, its length, tokens cached before it); tables: [S, max_blocks] int64. Rows of other
// tokens in out are left untouched.
void paged_prefill(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor starts,
                   torch::Tensor num_new, torch::Tensor computed, torch::Tensor tables, int64_t block_size,
                   double scale, torch::Tensor out) {
  const auto type = q.scalar_type();
  TORCH_CHECK((type == torch::kBFloat16 || type == torch::kFloat32) && k_pool.scalar_type() == type &&
              v_pool.scalar_type() == type && out.scalar_type() == type,
              "prompt attention runs on float32 or bfloat16 queries and pools, all of one type");
  TORCH_CHECK(prefill_ready(type == torch::kBFloat16),
              type == torch::kBFloat16 ? "bfloat16 prompt attention needs AMX tiles granted by the kernel"
                                       : "float32 prompt attention needs AVX-512");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 64 && q.stride(2) == 1 && q.stride(1) == 64, "head size 64, rows contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * 64);
  const int64_t S = starts.numel(), H = q.size(1), KVH = k_pool.size(1), slots = k_pool.size(0);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == 64 && num_new.numel() == S && computed.numel() == S &&
              tables.size(0) == S);
#if defined(__AVX512F__)
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* np = num_new.data_ptr<int64_t>();
  const int64_t* cp = computed.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t max_blocks = tables.size(1);
  std::vector<Chunk> chunks(S);
  int64_t packed = 0, widest = 0;
  for (int64_t i = 0; i < S; ++i) {
    Chunk& c = chunks[i];
    c = Chunk{sp[i], np[i], cp[i], packed, tp + i * max_blocks};
    TORCH_CHECK(c.n > 0 && c.computed >= 0 && c.start >= 0 && c.start + c.n <= q.size(0), "chunk out of range");
    TORCH_CHECK((c.keys() + block_size - 1) / block_size <= max_blocks, "block table too short");
    for (int64_t b = 0; b < (c.keys() + block_size - 1) / block_size; ++b)
      TORCH_CHECK(c.table[b] >= 0 && (c.table[b] + 1) * block_size <= slots, "block out of range");
    packed += KVH * c.padded() * 64;
    widest = std::max(widest, c.padded());
  }
  if (type == torch::kBFloat16)
    prefill_impl<bf16>(q, k_pool, v_pool, chunks, packed, widest, block_size, static_cast<float>(scale), out);
  else
    prefill_impl<float>(q, k_pool, v_pool, chunks, packed, widest, block_size, static_cast<float>(scale), out);
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32 or bfloat16 pool)");
  m.def("write_kv", &write_kv, "the new tokens' K and V into their pool slots");
  m.def("prefill_ready", &prefill_ready, "whether paged_prefill runs here for a bfloat16 (AMX) or float32 pool",
        py::arg("bfloat16"));
  m.def("paged_prefill", &paged_prefill,
        "causal prompt attention over the paged pool (head size 64; AMX in bfloat16, AVX-512 in float32)");
}
