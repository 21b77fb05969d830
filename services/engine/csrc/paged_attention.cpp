// Paged decode attention for the CPU: one query token per sequence, keys and values read in place
// from the block pool (no gather copy). Parallel over (sequence, KV head); the query heads that
// share a KV head are processed together so each K/V row is loaded once.
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
  const int64_t max_blocks = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, L = lp[b];
      const int64_t* table = tp + b * max_blocks;
      scores.assign(G * L, 0.f);
      std::vector<float> mx(G, -INFINITY), sum(G, 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        const float* krow = kp + (slot * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float s = dot(qp + (b * H + h * G + g) * D, krow, D) * sc;
          scores[g * L + l] = s;
          if (s > mx[g]) mx[g] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float total = 0.f;
        for (int64_t l = 0; l < L; ++l) { sg[l] = std::exp(sg[l] - mx[g]); total += sg[l]; }
        sum[g] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const int64_t slot = table[l / block_size] * block_size + l % block_size;
        const float* vrow = vp + (slot * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + l];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * vrow[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + h * G + g) * D;
        const float inv = 1.f / sum[g];
        for (int64_t i = 0; i < D; ++i) o[i] = acc[g * D + i] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}
