// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy). Parallel over sequences; each task walks its sequence's
// slots in order, so every slot's K (then V) row of all KV heads is one contiguous read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

static inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// q: [B, H, D]; k_pool, v_pool: [slots, KVH, D]; tables: [B, max_blocks] int64; lens: [B] int64.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor tables,
                           torch::Tensor lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_pool.scalar_type() == torch::kFloat32, "float32 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && tables.is_contiguous());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), G = H / KVH;
  const int64_t max_blocks = tables.size(1), row = KVH * D;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
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
      for (int64_t l = 0; l < L; ++l) {
        const float* krow = kp + (table[l / block_size] * block_size + l % block_size) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float s = dot(qb + h * D, krow + (h / G) * D, D) * sc;
          scores[h * L + l] = s;
          mx[h] = s > mx[h] ? s : mx[h];
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
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const float* vrow = vp + (table[l / block_size] * block_size + l % block_size) * row;
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * L + l];
          const float* v = vrow + (h / G) * D;
          float* a = acc.data() + h * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * v[i];
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* o = op + (b * H + h) * D;
        const float inv = 1.f / sum[h];
        for (int64_t i = 0; i < D; ++i) o[i] = acc[h * D + i] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
