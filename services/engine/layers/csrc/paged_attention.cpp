// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy). Parallel over sequences. On AVX-512 with a head size that is a
// multiple of 64, one pass over the sequence (online softmax, as FlashAttention and vLLM's CPU kernel do):
// each run of up to 16 consecutive slots has its K rows scored and its V rows summed while both are in L1,
// and the next run is prefetched meanwhile. Elsewhere two plain passes (scores, then values).
// The pool is float32 or bfloat16 (T); the query, the scores and every sum are float32.
// paged_prefill (prompt_attention.h) is the prompts' counterpart.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
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
static inline __m512 load16(const bf16* p) { return bf16x16::load(reinterpret_cast<const uint16_t*>(p)); }
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

// The same over a bfloat16 pool with AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and 5): the query rounded to
// bfloat16 (exact, as the model's query is bfloat16) and one vdpbf16ps per 32 elements, which multiplies the
// pairs exactly and sums them in float32, where the plain path widens every key element and runs two FMAs.
// Built at the avx512_bf16 and amx levels only (services/engine/layers/kernels.py), so a level is one path.
#if defined(__AVX512BF16__)
constexpr bool BF16_DOT = true;
template <int DV, bool Full>
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
#else
constexpr bool BF16_DOT = false;
#endif

// Dot products of one query head (q, and qh: the same rounded to T) with n (<= 16) consecutive key rows.
template <int DV, typename T>
static inline __m512 dots(const float* q, const T* qh, const T* k, int64_t row, int64_t n) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>)
    return n == 16 ? dots16_dpbf16<DV, true>(qh, k, row, n) : dots16_dpbf16<DV, false>(qh, k, row, n);
#endif
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
          if constexpr (BF16_DOT)
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

// The path paged_decode takes here for head sizes 64 and 128 (others take two plain passes), for the start-up line.
std::string decode_path(bool bfloat16) {
#if defined(__AVX512F__)
  return bfloat16 && BF16_DOT ? "one pass, vdpbf16ps (AVX512-BF16)" : "one pass, AVX-512 FMAs";
#else
  return "two plain passes (compiler-vectorized)";
#endif
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

#include "prompt_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU; float32 or bfloat16 pool)");
  m.def("write_kv", &write_kv, "the new tokens' K and V into their pool slots");
  m.def("prefill_ready", &prefill_ready, "whether paged_prefill runs here for a bfloat16 or float32 pool",
        py::arg("bfloat16"));
  m.def("prefill_path", &prefill_path, "the path paged_prefill takes here for a bfloat16 or float32 pool (or '')",
        py::arg("bfloat16"));
  m.def("decode_path", &decode_path, "the path paged_decode takes here for a bfloat16 or float32 pool, head size 64",
        py::arg("bfloat16"));
  m.def("paged_prefill", &paged_prefill,
        "causal prompt attention over the paged pool (head size 64; the path prefill_path names)");
}
