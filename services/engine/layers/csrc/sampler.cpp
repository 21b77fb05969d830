// Fused token sampler for the CPU: per row, bans, a grammar's token mask, temperature, min-p / top-k / top-p masking and
// Gumbel-max with counter-based noise, then the argmax, in one parallel pass over the logits
// (no noise tensor, no softmax tensor, no sort of the vocabulary).
//
// The noise of token v in a row is a pure function of (seed, position, v): SplitMix64 of
// row_key + (v + 1) * golden, where row_key = mix64(mix64(seed) + (position + 1) * golden),
// position = the request's output index. So a seeded request draws the same tokens alone or in
// any batch, in any worker, across preemption and KV export/import. The uniform u takes 23 bits,
// (k + 0.5) / 2^23, so u < 1 is exact in float, and the Gumbel noise -log(-log u) is at most 16.7.
// That bound lets a chunk whose largest scaled logit + 18 cannot beat the best score so far skip
// its noise: exact, and most of a real model's vocabulary is skipped.
//
// log and exp are Cephes' float polynomials written as plain IEEE operations; this file is built
// with -ffp-contract=off and without -ffast-math, so the PyTorch fallback in sampler.py computes
// the same noise bit for bit, and both give the same tokens for the same seeds.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr float kNoiseMax = 18.f;  // > the largest Gumbel noise, 16.64 at u = 1 - 2^-24
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kChunk = 512;
constexpr int kBuckets = 1024;  // value buckets of the top-p histogram
constexpr float kTailSpan = 40.f;  // top-p ignores tokens more than this below the max (mass e^-40)

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline float as_float(int32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline int32_t as_bits(float f) { int32_t b; std::memcpy(&b, &f, 4); return b; }

// log(x) for normal x > 0: Cephes' logf polynomial; constants as exact hex floats (LOG_POLY in sampler.py).
inline float log_poly(float x) {
  const int32_t bits = as_bits(x);
  const float e0 = static_cast<float>((bits >> 23) - 127);
  const float m0 = as_float((bits & 0x007FFFFF) | 0x3F800000);
  const bool big = m0 > 0x1.6a09e6p+0f;  // sqrt(2)
  const float m = big ? m0 * 0.5f : m0;
  const float e = big ? e0 + 1.f : e0;
  const float f = m - 1.f;
  const float z = f * f;
  float y = 0x1.204376p-4f;
  y = y * f + -0x1.d7a370p-4f;
  y = y * f + 0x1.de4a34p-4f;
  y = y * f + -0x1.fcba9ep-4f;
  y = y * f + 0x1.23d37ep-3f;
  y = y * f + -0x1.555ca0p-3f;
  y = y * f + 0x1.999d58p-3f;
  y = y * f + -0x1.fffff8p-3f;
  y = y * f + 0x1.555554p-2f;
  y = y * f * z;
  y = y - 0.5f * z;
  return f + y + e * 0x1.62e430p-1f;  // ln 2
}

// exp(x) for x <= 0 (Cephes expf); exp(-87) and below round to ~1.6e-38.
inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.f;
  return y * as_float((static_cast<int32_t>(n) + 127) << 23);
}

struct RowArgs {
  float temperature;  // 0 = greedy
  int64_t top_k;      // 0 = off
  float top_p;        // 1 = off
  float log_min_p;    // -inf = off
  uint64_t key;       // row_key(seed, position)
};

// Largest value and the first index holding it.
inline void argmax(const float* x, int64_t n, float& best, int64_t& best_i, int64_t offset) {
  float m = -kInf;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  if (m > best || best_i < 0) {
    int64_t i = 0;
    while (i < n - 1 && x[i] != m) ++i;
    best = m;
    best_i = offset + i;
  }
}

// The top-p cut: the largest value v* whose tokens at or above it hold at least p of the mass
// of the tokens at or above `floor` (and within kTailSpan of the max). One vectorised pass gives
// each token its mass and one of kBuckets value buckets (bucket order is value order), a scalar
// pass sums the masses per bucket, the bucket where the running mass reaches p*total is found,
// and only that bucket's tokens are sorted and walked exactly. When few tokens are above the floor
// (after top-k or min-p), they are first copied out and only they are looked at.
float top_p_threshold(const float* xs, float* e, int32_t* bucket, int64_t n, float mx, float floor, float p,
                      std::vector<float>& few) {
  const float lo0 = std::max(floor, mx - kTailSpan);
  int64_t kept = 0;
#pragma omp simd reduction(+ : kept)
  for (int64_t i = 0; i < n; ++i) kept += xs[i] >= lo0;
  if (kept * 8 < n) {
    few.resize(n + 1);
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {  // branch-free compaction
      few[count] = xs[i];
      count += xs[i] >= lo0;
    }
    xs = few.data();
    n = count;
  }
  float lowest = mx;  // the buckets span the kept values only
#pragma omp simd reduction(min : lowest)
  for (int64_t i = 0; i < n; ++i) lowest = xs[i] >= lo0 && xs[i] < lowest ? xs[i] : lowest;
  const float scale = static_cast<float>(kBuckets - 1) / std::max(mx - lowest, 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const bool kept = xs[i] >= lo0;
    e[i] = kept ? exp_poly(xs[i] - mx) : 0.f;
    const float d = kept ? std::min((mx - xs[i]) * scale, static_cast<float>(kBuckets - 1)) : 0.f;
    bucket[i] = kept ? static_cast<int32_t>(d) : kBuckets;  // kBuckets: below the floor
  }
  std::vector<float> sub(4 * (kBuckets + 1), 0.f);  // four interleaved histograms: no chain through one slot
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; ++j) sub[j * (kBuckets + 1) + bucket[i + j]] += e[i + j];
  for (; i < n; ++i) sub[bucket[i]] += e[i];
  std::vector<float> hist(kBuckets + 1);
  for (int b = 0; b <= kBuckets; ++b)
    hist[b] = (sub[b] + sub[kBuckets + 1 + b]) + (sub[2 * (kBuckets + 1) + b] + sub[3 * (kBuckets + 1) + b]);
  float total = 0.f;
  for (int b = 0; b < kBuckets; ++b) total += hist[b];
  const float target = p * total;
  float cum = 0.f;
  int b = 0;
  while (b < kBuckets && cum + hist[b] < target) cum += hist[b++];
  if (b == kBuckets) return lo0;  // rounding left the target out of reach: keep everything above the floor
  std::vector<std::pair<float, float>> band;  // (value, mass) of bucket b
  for (int64_t k = 0; k < n; ++k)
    if (bucket[k] == b) band.emplace_back(xs[k], e[k]);
  std::sort(band.begin(), band.end(), [](auto& x, auto& y) { return x.first > y.first; });
  for (auto& [value, mass] : band) {
    cum += mass;
    if (cum >= target) return value;
  }
  return band.back().first;
}

// The k-th largest value: the k-th largest of 64-wide group maxima bounds it from below, and only
// the values at or above that bound are selected among.
float top_k_threshold(const float* xs, int64_t n, int64_t k, std::vector<float>& scratch) {
  constexpr int64_t kGroup = 64;
  const int64_t groups = (n + kGroup - 1) / kGroup;
  scratch.resize(n + 1);
  int64_t count = n;
  if (k <= groups) {
    for (int64_t g = 0; g < groups; ++g) {
      float m = -kInf;
      const int64_t begin = g * kGroup, len = std::min(kGroup, n - begin);
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < len; ++i) m = xs[begin + i] > m ? xs[begin + i] : m;
      scratch[g] = m;
    }
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.begin() + groups, std::greater<float>());
    const float bound = scratch[k - 1];
    count = 0;
    for (int64_t i = 0; i < n; ++i) {  // branch-free compaction of the values >= bound
      scratch[count] = xs[i];
      count += xs[i] >= bound;
    }
  } else {
    std::copy(xs, xs + n, scratch.begin());
  }
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.begin() + count, std::greater<float>());
  return scratch[k - 1];
}

// The Gumbel noise of token v of a row: -log(-log u), u from the 23 top bits of SplitMix64.
inline float uniform(uint64_t key, int64_t v) {
  const uint64_t z = mix64(key + static_cast<uint64_t>(v + 1) * kGolden);
  return (static_cast<float>(static_cast<int32_t>(z >> 41)) + 0.5f) * 1.1920928955078125e-7f;
}

inline float score(float x, uint64_t key, int64_t v) { return x - log_poly(-log_poly(uniform(key, v))); }

// Gumbel-max over the row's scaled, masked logits xs. The chunk holding the largest value is scored
// in full first; after that a token is scored only if it could beat the best score so far:
// x - log(E) > best needs E < exp(x - best), and E = -log u >= 1 - u, so a token whose
// 1 - u >= 4 * 2^ceil((x - best) * log2 e) (an upper bound of exp(x - best) with room for
// rounding) cannot win. That test is a hash and a compare; about 20 tokens of a row pass it.
int64_t gumbel_argmax(const float* xs, int64_t n, uint64_t key, int64_t first_chunk, float* s, uint8_t* pass) {
  float best = -kInf;
  int64_t best_i = -1;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  {
    const int64_t c0 = first_chunk * kChunk, len = std::min(kChunk, n - c0);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] = score(xs[c0 + i], key, c0 + i);
    argmax(s, len, best, best_i, c0);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (c == first_chunk) continue;
    const int64_t c0 = c * kChunk, len = std::min(kChunk, n - c0);
    const float* x = xs + c0;
    float cm = -kInf;
#pragma omp simd reduction(max : cm)
    for (int64_t i = 0; i < len; ++i) cm = x[i] > cm ? x[i] : cm;
    if (cm + kNoiseMax < best) continue;
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t i = 0; i < len; ++i) {
      const float k = std::max(std::ceil((x[i] - best) * 1.44269504088896341f) + 2.f, -126.f);
      const float bound = as_float((static_cast<int32_t>(std::min(k, 127.f)) + 127) << 23);
      pass[i] = (1.f - uniform(key, c0 + i)) < bound;
      any |= pass[i];
    }
    if (!any) continue;
    for (int64_t i = 0; i < len; ++i) {
      if (!pass[i]) continue;
      const float si = score(x[i], key, c0 + i);
      if (si > best || (si == best && c0 + i < best_i)) {
        best = si;
        best_i = c0 + i;
      }
    }
  }
  return best_i;
}

float log_softmax_at(const float* x, int64_t n, int64_t token) {
  float mx = -kInf;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += exp_poly(x[i] - mx);
  return x[token] - mx - std::log(sum);
}

int64_t sample_row(const float* x, int64_t n, const RowArgs& a, const int64_t* ban, int64_t n_ban,
                   const int32_t* allow, std::vector<float>& xs, std::vector<float>& work, std::vector<float>& scratch,
                   std::vector<uint8_t>& pass, std::vector<int32_t>& buckets) {
  float* row = xs.data();
  const float t = a.temperature > 0.f ? a.temperature : 1.f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) row[i] = x[i] / t;
  for (int64_t b = 0; b < n_ban; ++b) row[ban[b]] = -kInf;
  if (allow) {  // a grammar's token mask: bit v of the row's bitmask set = token v may be sampled
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = (allow[i >> 5] >> (i & 31)) & 1 ? row[i] : -kInf;
  }
  float mx = -kInf;
  int64_t mx_i = -1;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) argmax(row + c0, std::min(kChunk, n - c0), mx, mx_i, c0);
  if (a.temperature <= 0.f) return mx_i;
  float thr = -kInf;
  if (a.log_min_p > -kInf) thr = mx + a.log_min_p;
  if (a.top_k > 0 && a.top_k < n) thr = std::max(thr, top_k_threshold(row, n, a.top_k, scratch));
  if (a.top_p < 1.f)
    thr = std::max(thr, top_p_threshold(row, work.data(), buckets.data(), n, mx, thr, a.top_p, scratch));
  if (thr > -kInf) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = row[i] >= thr ? row[i] : -kInf;
  }
  return gumbel_argmax(row, n, a.key, mx_i / kChunk, work.data(), pass.data());
}

}  // namespace

// logits [B, V] float32 or bfloat16 (each row widened to float32 as it is sampled: exact, and the whole [B, V]
// float32 copy a separate .float() wrote and this pass read back is never made); temperature, top_p, log_min_p [B] float32; top_k, seeds, positions [B] int64;
// ban_offsets [B + 1] and ban_ids int64 (tokens row b may not sample: ban_ids[ban_offsets[b]:ban_offsets[b+1]]);
// want_logprobs [B] bool; allow_rows [B] int64 and allow [M, ceil(V / 32)] int32: row b may sample only the tokens
// whose bits are set in allow[allow_rows[b]] (a grammar's mask), or any token where allow_rows[b] < 0.
// Returns (tokens [B] int64, logprobs [B] float32, NaN where not asked).
std::vector<torch::Tensor> sample(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                                  torch::Tensor top_p, torch::Tensor log_min_p, torch::Tensor seeds,
                                  torch::Tensor positions, torch::Tensor ban_offsets, torch::Tensor ban_ids,
                                  torch::Tensor want_logprobs, torch::Tensor allow_rows, torch::Tensor allow) {
  const bool wide = logits.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == torch::kFloat32 || wide) && logits.is_contiguous(),
              "logits must be a contiguous float32 or bfloat16 [B, V] tensor");
  const int64_t B = logits.size(0), V = logits.size(1), W = (V + 31) / 32;
  TORCH_CHECK(allow_rows.numel() == B && allow.scalar_type() == torch::kInt32 && allow.dim() == 2 &&
              allow.is_contiguous() && (allow.size(0) == 0 || allow.size(1) == W),
              "allow must be a contiguous int32 [M, ceil(V / 32)] bitmask and allow_rows [B] int64");
  const int64_t* ar = allow_rows.data_ptr<int64_t>();
  const int32_t* al = allow.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ar[b] < allow.size(0), "allow_rows[", b, "] is out of range");
  auto tokens = torch::empty({B}, torch::kInt64);
  auto logprobs = torch::full({B}, std::numeric_limits<float>::quiet_NaN(), torch::kFloat32);
  const float* lp = wide ? nullptr : logits.data_ptr<float>();
  const uint16_t* lp16 = wide ? reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()) : nullptr;
  const float* tp = temperature.data_ptr<float>();
  const float* pp = top_p.data_ptr<float>();
  const float* mp = log_min_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const int64_t* sp = seeds.data_ptr<int64_t>();
  const int64_t* posp = positions.data_ptr<int64_t>();
  const int64_t* bo = ban_offsets.data_ptr<int64_t>();
  const int64_t* bi = ban_ids.data_ptr<int64_t>();
  const bool* wl = want_logprobs.data_ptr<bool>();
  int64_t* out = tokens.data_ptr<int64_t>();
  float* out_lp = logprobs.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(V), work(std::max<int64_t>(V, kChunk)), scratch, widened(wide ? V : 0);
    std::vector<uint8_t> pass(kChunk);
    std::vector<int32_t> buckets(V);
    for (int64_t b = begin; b < end; ++b) {
      const uint64_t seed = static_cast<uint64_t>(sp[b]), pos = static_cast<uint64_t>(posp[b]);
      const RowArgs a{tp[b], kp[b], pp[b], mp[b], mix64(mix64(seed) + (pos + 1) * kGolden)};
      const float* x = lp + b * V;
      if (wide) {  // bfloat16 is the top half of a float32
        const uint16_t* h = lp16 + b * V;
        uint32_t* w = reinterpret_cast<uint32_t*>(widened.data());
#pragma omp simd
        for (int64_t i = 0; i < V; ++i) w[i] = static_cast<uint32_t>(h[i]) << 16;
        x = widened.data();
      }
      const int32_t* allowed = ar[b] >= 0 ? al + ar[b] * W : nullptr;
      out[b] = sample_row(x, V, a, bi + bo[b], bo[b + 1] - bo[b], allowed, xs, work, scratch, pass, buckets);
      if (wl[b]) out_lp[b] = log_softmax_at(x, V, out[b]);
    }
  });
  return {tokens, logprobs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample", &sample, "fused Gumbel-max sampler with grammar masks, min-p / top-k / top-p (CPU, float32 or bfloat16 logits)");
}
