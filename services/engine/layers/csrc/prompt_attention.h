// Prompt attention over the paged pool (head size 64), included once by paged_attention.cpp: every prefill chunk of
// a step, whether it starts its sequence or continues one, attends causally to its sequence's keys, read from the
// pool through the block table. Per sequence and KV head the keys and values are first repacked (once, shared by
// the G query heads and every block of queries); then each block of 16 queries of one head is scored against its
// keys, its softmax taken over whole rows (the scores of 16 rows fit in L2 for any context here, so no online
// rescaling), and its values summed. Blocks go to the threads costliest first.
//
// One path per build level (services/engine/layers/kernels.py), so that a level names the code it runs:
//   amx          bfloat16 on AMX tiles: two 16 x 32 by 32 x 16 tile products per 16 keys, four accumulator
//                tiles (16 x 64 float32) for the values, where Linux grants the tiles (else as avx512_bf16)
//   avx512_bf16  bfloat16 on vdpbf16ps (AMD Zen 4 and 5, Intel Cooper Lake): the same packed layout as the
//                tiles, one instruction per pair of elements of 16 keys (scores) or of 16 elements (values)
//   avx512, avx2 bfloat16 widened to float32, and float32 as it is: FMAs on 16 lanes (one AVX-512 register or
//                two AVX2 ones: vec16.h), keys transposed 16 at a time
// float32 takes the last path at every level from avx2 up. On the bfloat16 dot-product paths the weights are
// rounded to bfloat16 before the value product, as torch's flash kernel does; on the widened path they stay
// float32. Every sum is float32.
#pragma once
#include <atomic>
#include <string>
#include "vec16.h"

#if defined(MESHSERVE_VEC16)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

enum class PromptPath { None, Tiles, DotBF16, Wide };

#if defined(__AMX_BF16__)
// The CPU has AMX (tiles and bfloat16 products) and Linux grants this process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 and later; oneDNN asks the same way). Asked once.
static bool amx_ready() {
  static const bool yes = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16_tile = d & (1u << 22);
    if (!tile || !bf16_tile) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return yes;
}
#endif

static PromptPath prompt_path(bool bfloat16) {
  if (!bfloat16) return PromptPath::Wide;
#if defined(__AMX_BF16__)
  if (amx_ready()) return PromptPath::Tiles;
#endif
#if defined(__AVX512BF16__)
  return PromptPath::DotBF16;
#else
  return PromptPath::Wide;
#endif
}

// One sequence's prefill chunk: n queries from flat row `start`, after `computed` tokens already cached.
struct Chunk {
  int64_t start, n, computed, packed;  // packed: offset of its repacked K (and V) in the step's buffers
  const int64_t* table;
  int64_t keys() const { return computed + n; }
  int64_t padded() const { return (keys() + 31) / 32 * 32; }
};

// A block's 16 query rows of head h (64 elements each) into qb, as Q (bfloat16 copied, or widened to float32),
// rows past the chunk's end zero.
template <typename T, typename Q>
static void fill_queries(const T* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, int64_t rows, Q* qb) {
  for (int64_t r = 0; r < 16; ++r) {
    const T* src = q + (c.start + q0 + r) * q_row + h * 64;
    for (int d = 0; d < 64; ++d) qb[r * 64 + d] = r < rows ? static_cast<Q>(src[d]) : Q(0);
  }
}

// key j's row in the pool for KV head g, block by block (no division per key); kept per thread
template <typename T>
static const std::vector<const T*>& key_rows(const T* pool, const Chunk& c, int64_t g, int64_t block_size,
                                             int64_t row, std::vector<const T*>& rows) {
  const int64_t L = c.keys();
  rows.resize(L + 1);
  for (int64_t b = 0, j = 0; j < L; ++b)
    for (int64_t i = 0, base = c.table[b] * block_size; i < block_size && j < L; ++i, ++j)
      rows[j] = pool + (base + i) * row + g * 64;
  return rows;
}

// softmax(scale * scores) of 16 rows of s ([16, width] float32) into p ([16, width], P float32 or bfloat16): row r
// sees keys 0 .. seen0 + r - 1 (rows from `rows` on are padding: all zero). Its maximum, then
// exp(scale * (s - max)) (the inline exp of avx512_math.h / vec16.h, ~2 ulp), summed unrounded into inv[r] = 1 / sum.
// Only the last 16 keys a row sees can be partly masked.
template <typename P>
static void softmax_rows(const float* s, P* p, int64_t width, int64_t rows, int64_t seen0, float scale, float* inv) {
  const Vec16 sc = Vec16::all(scale);
  for (int64_t r = 0; r < 16; ++r) {
    const float* sr = s + r * width;
    P* pr = p + r * width;
    if (r >= rows) {
      std::memset(pr, 0, width * sizeof(P));
      continue;
    }
    const int64_t seen = seen0 + r, full = seen / 16 * 16;
    const int tail = static_cast<int>(seen - full);
    Vec16 m = Vec16::all(-1e30f);  // finite: -ffast-math assumes no infinities
    for (int64_t j = 0; j < full; j += 16) m = max(m, Vec16::load(sr + j));
    if (tail) m = max(m, Vec16::load_first(sr + full, tail, -1e30f));
    const Vec16 shift = Vec16::all(-scale * m.max());
    Vec16 total = Vec16::zero();
    int64_t j = 0;
    for (; j < full; j += 16) {
      const Vec16 w = exp(fma(Vec16::load(sr + j), sc, shift));
      total = total + w;
      w.store(pr + j);
    }
    if (tail) {  // the partly masked run
      const Vec16 w = exp(fma(Vec16::load(sr + j), sc, shift)).first(tail);
      total = total + w;
      w.store(pr + j);
      j += 16;
    }
    std::memset(pr + j, 0, (width - j) * sizeof(P));  // runs wholly past the row's last key
    inv[r] = 1.f / total.sum();
  }
}

// ---- bfloat16 dot products: AMX tiles, or vdpbf16ps over the same layout -------------------------------------
#if defined(__AVX512BF16__)
// K rows of one KV head into B tiles of 16 keys: two tiles per 16 keys (pairs of elements 0-31, 32-63), each row
// of a tile one pair-index, 16 keys x 2 elements (64 bytes): pair p of key block b at kp + b * 1024 + p * 32.
// V rows into B tiles of 32 keys: four per 32 keys (elements 16 at a time), each row a pair of consecutive keys,
// 16 elements x 2 keys: key pair jp, elements 16e.. at vp + (jp / 16) * 2048 + e * 512 + (jp % 16) * 32. Keys past
// the end are zero.
static void pack_kv(const bf16* k_pool, const bf16* v_pool, const Chunk& c, int64_t g, int64_t block_size,
                    int64_t row, bf16* kp, bf16* vp) {
  const int64_t L = c.keys(), Lp = c.padded();
  std::memset(kp + L / 16 * 1024, 0, (Lp * 64 - L / 16 * 1024) * sizeof(bf16));  // the blocks keys past L fall in
  std::memset(vp + L / 32 * 2048, 0, (Lp * 64 - L / 32 * 2048) * sizeof(bf16));
  thread_local std::vector<const bf16*> krow_buf, vrow_buf;
  const auto& krow = key_rows(k_pool, c, g, block_size, row, krow_buf);
  const auto& vrow = key_rows(v_pool, c, g, block_size, row, vrow_buf);
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp);
  for (int64_t j = 0; j < L; ++j) {
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(krow[j]);
    uint32_t* kt = kp32 + (j / 16) * 512 + (j % 16);  // + pair * 16
    for (int p = 0; p < 32; ++p) kt[p * 16] = kr[p];
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

// The scratch of one block of up to 16 queries of head h (rows q0 .. q0 + rows - 1 of the chunk): s [16, width]
// float32 scores, p [16, width] bfloat16 weights, qb [16, 64] bfloat16 queries, o [16, 64] float32 sums.
struct DotScratch {
  float* s;
  bf16* p;
  bf16* qb;
  float* o;
};

// The block's 16 x 64 float32 sums (o), scaled by each row's 1 / total, into its rows of out.
static void store_rows(const float* o, const float* inv, const Chunk& c, int64_t h, int64_t q0, int64_t rows,
                       bf16* out, int64_t out_row) {
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = out + (c.start + q0 + r) * out_row + h * 64;
    for (int d = 0; d < 64; d += 16) (Vec16::load(o + r * 64 + d) * Vec16::all(inv[r])).store(dst + d);
  }
}

// vdpbf16ps: scores with 16 row accumulators per 16 keys (a pair of query elements broadcast, a packed pair-row of
// 16 keys loaded once for the 16 rows), values with 4 rows x 64 elements of accumulators per pair of keys.
static void prefill_block_dot(const bf16* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, const bf16* kp,
                              const bf16* vp, float scale, bf16* out, int64_t out_row, const DotScratch& x) {
  const int64_t rows = std::min<int64_t>(16, c.n - q0);
  const int64_t limit = c.computed + q0 + rows;  // keys the block's last query sees
  const int64_t chunks = (limit + 31) / 32, width = chunks * 32;  // keys scored, in 32s
  fill_queries(q, q_row, c, h, q0, rows, x.qb);
  const int32_t* qp = reinterpret_cast<const int32_t*>(x.qb);  // row r's element pair e at qp[r * 32 + e]
  for (int64_t kb = 0; kb < 2 * chunks; ++kb) {
    const bf16* kt = kp + kb * 1024;
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int e = 0; e < 32; ++e) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt + e * 32);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(qp[r * 32 + e]), kv);
    }
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(x.s + r * width + kb * 16, acc[r]);
  }
  float inv[16];
  softmax_rows(x.s, x.p, width, rows, c.computed + q0 + 1, scale, inv);
  const int32_t* pw = reinterpret_cast<const int32_t*>(x.p);  // row r's key pair jp at pw[r * width / 2 + jp]
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) acc[i][e] = _mm512_setzero_ps();
    const int64_t seen = c.computed + q0 + std::min<int64_t>(r0 + 4, rows);  // keys the group's last row sees
    for (int64_t jp = 0; jp < (seen + 1) / 2; ++jp) {
      const bf16* vt = vp + (jp / 16) * 2048 + (jp % 16) * 32;
      __m512bh v[4];
      for (int e = 0; e < 4; ++e) v[e] = (__m512bh)_mm512_loadu_si512(vt + e * 512);
      for (int i = 0; i < 4; ++i) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[(r0 + i) * (width / 2) + jp]);
        for (int e = 0; e < 4; ++e) acc[i][e] = _mm512_dpbf16_ps(acc[i][e], w, v[e]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int e = 0; e < 4; ++e) _mm512_storeu_ps(x.o + (r0 + i) * 64 + 16 * e, acc[i][e]);
  }
  store_rows(x.o, inv, c, h, q0, rows, out, out_row);
}
#endif

#if defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 drops the stores above as dead without this
  _tile_loadconfig(&cfg);
}

static void release_tiles() { _tile_release(); }

// AMX: the block's scores on the tiles (two products per 16 keys), its values on four accumulator tiles.
static void prefill_block_tiles(const bf16* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, const bf16* kp,
                                const bf16* vp, float scale, bf16* out, int64_t out_row, const DotScratch& x) {
  const int64_t rows = std::min<int64_t>(16, c.n - q0);
  const int64_t limit = c.computed + q0 + rows;
  const int64_t chunks = (limit + 31) / 32, width = chunks * 32;
  fill_queries(q, q_row, c, h, q0, rows, x.qb);
  _tile_loadd(0, x.qb, 128);       // queries, elements 0-31
  _tile_loadd(1, x.qb + 32, 128);  // queries, elements 32-63
  for (int64_t kb = 0; kb < 2 * chunks; ++kb) {
    _tile_zero(4);
    _tile_loadd(2, kp + kb * 1024, 64);
    _tile_loadd(3, kp + kb * 1024 + 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, x.s + kb * 16, width * sizeof(float));
  }
  float inv[16];
  softmax_rows(x.s, x.p, width, rows, c.computed + q0 + 1, scale, inv);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const bf16* vt = vp + kc * 2048;
    _tile_loadd(0, x.p + kc * 32, width * sizeof(bf16));
    _tile_loadd(1, vt, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, vt + 512, 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(3, vt + 1024, 64);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, vt + 1536, 64);
    _tile_dpbf16ps(7, 0, 1);
  }
  _tile_stored(4, x.o, 256);
  _tile_stored(5, x.o + 16, 256);
  _tile_stored(6, x.o + 32, 256);
  _tile_stored(7, x.o + 48, 256);
  store_rows(x.o, inv, c, h, q0, rows, out, out_row);
}
#endif

// ---- float32 FMAs: float32 as it is, bfloat16 widened -----------------------------------------------------------
#if defined(__AVX512F__)
constexpr int SCORE_ROWS = 16;                // query rows scored at once: 16 accumulators of 32 registers
constexpr int VALUE_ROWS = 4, VALUE_VECS = 4;  // rows x 16-element vectors summed at once: 16 accumulators
#else
constexpr int SCORE_ROWS = 4;                 // AVX2 has 16 registers, a Vec16 takes two
constexpr int VALUE_ROWS = 2, VALUE_VECS = 2;
#endif

// Keys transposed 16 at a time (kt: [L / 16][64][16]: a vector holds one element of 16 keys), values copied into
// rows in key order (vr: [L][64]), both widened to float32.
template <typename T>
static void pack_kv_wide(const T* k_pool, const T* v_pool, const Chunk& c, int64_t g, int64_t block_size,
                         int64_t row, float* kt, float* vr) {
  const int64_t L = c.keys(), Lp = c.padded();
  std::memset(kt + L / 16 * 1024, 0, (Lp * 64 - L / 16 * 1024) * sizeof(float));
  std::memset(vr + L * 64, 0, (Lp - L) * 64 * sizeof(float));
  thread_local std::vector<const T*> krow_buf, vrow_buf;
  const auto& krow = key_rows(k_pool, c, g, block_size, row, krow_buf);
  const auto& vrow = key_rows(v_pool, c, g, block_size, row, vrow_buf);
  for (int64_t j = 0; j < L; ++j) {
    float* t = kt + (j / 16) * 1024 + (j % 16);
    for (int d = 0; d < 64; ++d) t[d * 16] = f32(krow[j][d]);
    for (int d = 0; d < 64; d += 16) Vec16::load(vrow[j] + d).store(vr + j * 64 + d);
  }
}

struct WideScratch {
  float *s, *p, *qb;  // [16, width] scores, [16, width] weights, [16, 64] queries
};

// A block's scores: SCORE_ROWS accumulators per 16 keys, each element of the head one vector load and SCORE_ROWS
// FMAs with the queries' elements broadcast; then 16 keys' values summed VALUE_ROWS x VALUE_VECS at a time.
template <typename T>
static void prefill_block_wide(const T* q, int64_t q_row, const Chunk& c, int64_t h, int64_t q0, const float* kt,
                               const float* vr, float scale, T* out, int64_t out_row, const WideScratch& x) {
  const int64_t rows = std::min<int64_t>(16, c.n - q0);
  const int64_t limit = c.computed + q0 + rows;
  const int64_t blocks = (limit + 15) / 16, width = blocks * 16;
  fill_queries(q, q_row, c, h, q0, rows, x.qb);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const float* k = kt + kb * 1024;
    for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
      Vec16 acc[SCORE_ROWS];
      for (int r = 0; r < SCORE_ROWS; ++r) acc[r] = Vec16::zero();
      for (int d = 0; d < 64; ++d) {
        const Vec16 kv = Vec16::load(k + d * 16);
        for (int r = 0; r < SCORE_ROWS; ++r) acc[r] = fma(Vec16::all(x.qb[(r0 + r) * 64 + d]), kv, acc[r]);
      }
      for (int r = 0; r < SCORE_ROWS; ++r) acc[r].store(x.s + (r0 + r) * width + kb * 16);
    }
  }
  float inv[16];
  softmax_rows(x.s, x.p, width, rows, c.computed + q0 + 1, scale, inv);
  for (int64_t r0 = 0; r0 < rows; r0 += VALUE_ROWS) {
    const int64_t seen = c.computed + q0 + std::min<int64_t>(r0 + VALUE_ROWS, rows);  // the group's last row's keys
    for (int e0 = 0; e0 < 64; e0 += 16 * VALUE_VECS) {
      Vec16 acc[VALUE_ROWS][VALUE_VECS];
      for (int i = 0; i < VALUE_ROWS; ++i)
        for (int e = 0; e < VALUE_VECS; ++e) acc[i][e] = Vec16::zero();
      for (int64_t j = 0; j < seen; ++j) {
        Vec16 v[VALUE_VECS];
        for (int e = 0; e < VALUE_VECS; ++e) v[e] = Vec16::load(vr + j * 64 + e0 + 16 * e);
        for (int i = 0; i < VALUE_ROWS; ++i) {
          const Vec16 w = Vec16::all(x.p[(r0 + i) * width + j]);
          for (int e = 0; e < VALUE_VECS; ++e) acc[i][e] = fma(w, v[e], acc[i][e]);
        }
      }
      for (int i = 0; i < VALUE_ROWS && r0 + i < rows; ++i) {
        T* dst = out + (c.start + q0 + r0 + i) * out_row + h * 64 + e0;
        for (int e = 0; e < VALUE_VECS; ++e) (acc[i][e] * Vec16::all(inv[r0 + i])).store(dst + 16 * e);
      }
    }
  }
}

// ---- the step: repack, then blocks of 16 queries with all their heads -------------------------------------------
// T: the pool's and queries' type; K: the repacked keys' type (bfloat16 for the tiles and vdpbf16ps, else float32).
// The chunks' keys and values are repacked (one task per chunk and KV head), then the blocks of 16 queries with all
// their heads, costliest first, taken in turn by whichever thread is free. Scratch stays with its thread between
// calls (a step's layers all need about the same): no allocation, page faults or zeroing per call.
template <typename T, typename K>
static void prefill_impl(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const std::vector<Chunk>& chunks, int64_t packed, int64_t widest, int64_t block_size,
                         float scale, at::Tensor& out, PromptPath path) {
  const int64_t S = chunks.size(), H = q.size(1), KVH = k_pool.size(1), G = H / KVH;
  static thread_local std::vector<K> kp, vp;
  if (static_cast<int64_t>(kp.size()) < packed) kp.resize(packed), vp.resize(packed);
  K *kpd = kp.data(), *vpd = vp.data();  // (inside the parallel regions kp names each thread's own)
  const T *kpool = k_pool.data_ptr<T>(), *vpool = v_pool.data_ptr<T>(), *qp = q.data_ptr<T>();
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i / KVH];
      const int64_t g = i % KVH, at = c.packed + g * c.padded() * 64;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<K, bf16>) {
        pack_kv(kpool, vpool, c, g, block_size, KVH * 64, kpd + at, vpd + at);
        continue;
      }
#endif
      if constexpr (std::is_same_v<K, float>) pack_kv_wide(kpool, vpool, c, g, block_size, KVH * 64, kpd + at, vpd + at);
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
    static thread_local std::vector<K> p, qb(16 * 64);
    if (static_cast<int64_t>(s.size()) < 16 * widest) s.resize(16 * widest), p.resize(16 * widest);
#if defined(__AMX_BF16__)
    if (path == PromptPath::Tiles) load_tiles();
#endif
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Chunk& c = chunks[items[i].chunk];
      for (int64_t h = 0; h < H; ++h) {
        const int64_t at = c.packed + (h / G) * c.padded() * 64;
        if constexpr (std::is_same_v<K, float>) {
          prefill_block_wide(qp, q.stride(0), c, h, items[i].q0, kpd + at, vpd + at, scale, op, H * 64,
                             WideScratch{s.data(), p.data(), qb.data()});
        }
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<K, bf16>) {
          const DotScratch x{s.data(), p.data(), qb.data(), o.data()};
#if defined(__AMX_BF16__)
          if (path == PromptPath::Tiles) {
            prefill_block_tiles(qp, q.stride(0), c, h, items[i].q0, kpd + at, vpd + at, scale, op, H * 64, x);
            continue;
          }
#endif
          prefill_block_dot(qp, q.stride(0), c, h, items[i].q0, kpd + at, vpd + at, scale, op, H * 64, x);
        }
#endif
      }
    }
#if defined(__AMX_BF16__)
    if (path == PromptPath::Tiles) release_tiles();
#endif
  });
}
#else
enum class PromptPath { None };
static PromptPath prompt_path(bool) { return PromptPath::None; }
#endif

// Whether paged_prefill runs here for that pool type: from the avx2 level up (a generic build has no prompt kernel).
bool prefill_ready(bool bfloat16) { return prompt_path(bfloat16) != PromptPath::None; }

// The path paged_prefill takes here for that pool type, for the engine's start-up line ("" where it does not run).
std::string prefill_path(bool bfloat16) {
#if defined(MESHSERVE_VEC16)
  const char* fma = "float32 FMAs (" MESHSERVE_VEC16_ISA ")";
  switch (prompt_path(bfloat16)) {
    case PromptPath::Tiles: return "AMX tiles";
    case PromptPath::DotBF16: return "vdpbf16ps (AVX512-BF16)";
    case PromptPath::Wide: return bfloat16 ? std::string(fma) + ", bfloat16 widened" : fma;
    default: break;
  }
#endif
  return "";
}

// out[rows of each chunk] = causal attention of the chunk's queries over its sequence's keys in the pool.
// q: [T, H, 64] float32 or bfloat16, rows any stride apart (a view of the fused qkv projection); pools
// [slots, KVH, 64] and out [T, H * 64] (contiguous) of the same type; starts, num_new, computed: [S] int64 (flat row
// of each chunk's first query, its length, tokens cached before it); tables: [S, max_blocks] int64. Rows of other
// tokens in out are left untouched.
void paged_prefill(at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor starts, at::Tensor num_new,
                   at::Tensor computed, at::Tensor tables, int64_t block_size, double scale, at::Tensor out) {
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && k_pool.scalar_type() == type &&
              v_pool.scalar_type() == type && out.scalar_type() == type,
              "prompt attention runs on float32 or bfloat16 queries and pools, all of one type");
  TORCH_CHECK(prefill_ready(type == at::kBFloat16), "prompt attention needs a build for AVX2 or wider (this one is generic)");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 64 && q.stride(2) == 1 && q.stride(1) == 64, "head size 64, rows contiguous");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * 64);
  const int64_t S = starts.numel(), H = q.size(1), KVH = k_pool.size(1), slots = k_pool.size(0);
  TORCH_CHECK(H % KVH == 0 && k_pool.size(2) == 64 && num_new.numel() == S && computed.numel() == S &&
              tables.size(0) == S);
#if defined(MESHSERVE_VEC16)
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
  const PromptPath path = prompt_path(type == at::kBFloat16);
  const float sc = static_cast<float>(scale);
  if (type == at::kFloat) {
    prefill_impl<float, float>(q, k_pool, v_pool, chunks, packed, widest, block_size, sc, out, path);
  } else if (path == PromptPath::Wide) {
    prefill_impl<bf16, float>(q, k_pool, v_pool, chunks, packed, widest, block_size, sc, out, path);
  } else {
#if defined(__AVX512BF16__)
    prefill_impl<bf16, bf16>(q, k_pool, v_pool, chunks, packed, widest, block_size, sc, out, path);
#endif
  }
#endif
}
