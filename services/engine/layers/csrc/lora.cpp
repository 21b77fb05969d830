// Segmented LoRA on the CPU, in the spirit of Punica's SGMV: the batch's rows are grouped by adapter slot
// (the engine orders the batch so that each slot's rows are contiguous), and for every segment
//   out[rows, col:col+w] += (x[rows] @ A[slot][:r]^T) @ B[slot][:r]
// with the slot's own rank r (the stacks are padded to the largest rank; the padding is never read).
// A segment of a few rows (decode tokens) runs in the loops below, whose every access is contiguous
// (A holds lora_A as PEFT stores it, [rank, in]; B holds the scaled lora_B transposed, [rank, out]);
// a longer one (a prefill chunk) runs as two GEMMs through ATen, where a blocked kernel pays off.
#include "torch_lite.h"

constexpr int64_t SMALL_ROWS = 16;  // segments of at most this many rows run in the loops here
constexpr int64_t MAX_RANK = 256;

// out: [T, W] float32 rows (any row stride), x: [T, in] float32 rows, A: [S, R, in], B: [S, R, w] (contiguous),
// segs: [n, 3] int64 (first row, end row, slot), ranks: [S] int32 (0 = this slot has no such target).
void lora_apply_(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& A, const torch::Tensor& B,
                 const torch::Tensor& segs, const torch::Tensor& ranks, int64_t col) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat && x.scalar_type() == torch::kFloat &&
              A.scalar_type() == torch::kFloat && B.scalar_type() == torch::kFloat, "lora_apply_: float32 only");
  TORCH_CHECK(out.stride(1) == 1 && x.stride(1) == 1 && A.is_contiguous() && B.is_contiguous() &&
              segs.is_contiguous() && ranks.is_contiguous(), "lora_apply_: rows must be contiguous");
  TORCH_CHECK(segs.scalar_type() == torch::kLong && ranks.scalar_type() == torch::kInt, "lora_apply_: index types");
  const int64_t in = x.size(1), R = A.size(1), w = B.size(2), n = segs.size(0), S = A.size(0);
  TORCH_CHECK(A.size(2) == in && B.size(1) == R && B.size(0) == S && R <= MAX_RANK && col + w <= out.size(1),
              "lora_apply_: shapes do not agree");
  const int64_t* sg = segs.data_ptr<int64_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = sg[3 * i], end = sg[3 * i + 1], slot = sg[3 * i + 2];
    TORCH_CHECK(slot >= 0 && slot < S && start >= 0 && end <= x.size(0) && end <= out.size(0), "lora_apply_: bad segment");
    const int64_t r = rk[slot];
    if (r == 0 || end <= start) continue;
    if (end - start > SMALL_ROWS) {
      auto xa = at::mm(x.narrow(0, start, end - start), A[slot].narrow(0, 0, r).t());
      out.narrow(0, start, end - start).narrow(1, col, w).addmm_(xa, B[slot].narrow(0, 0, r));
      continue;
    }
    const float* a = A.data_ptr<float>() + slot * R * in;
    const float* b = B.data_ptr<float>() + slot * R * w;
    float xa[MAX_RANK];
    for (int64_t t = start; t < end; ++t) {
      const float* xr = xp + t * xs;
      for (int64_t k = 0; k < r; ++k) {
        const float* ak = a + k * in;
        float s = 0.f;
        for (int64_t j = 0; j < in; ++j) s += xr[j] * ak[j];
        xa[k] = s;
      }
      float* o = op + t * os + col;
      for (int64_t k = 0; k < r; ++k) {
        const float* bk = b + k * w;
        const float c = xa[k];
        for (int64_t j = 0; j < w; ++j) o[j] += c * bk[j];
      }
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_apply_", &lora_apply_, "add each segment's LoRA delta (its slot's A and B) to out in place");
}
