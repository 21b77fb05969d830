// The all-reduce of a tensor-parallel group whose ranks share a host: one shared-memory segment, no sockets.
//
// The segment (services/engine/parallel.py makes it) holds a header line per rank (its sequence number and pid)
// and two data buffers per rank. A call copies the rank's partial sums into its buffer of this round's parity,
// publishes the round's number (a release store), waits until every rank has published it (acquire loads), then
// adds the ranks' buffers in rank order, in float32, into its own tensor. Every rank adds the same values in the
// same order, so every rank gets the same bits (the ranks must agree exactly: each writes its KV heads from the
// sum). Two buffers per rank make one barrier per call enough: a rank writes round n into the buffer of round
// n - 2 only after every rank has published n - 1, which each does after it finished reading round n - 2 (after
// an all-reduce that is already so; after a gather, where only rank 0 reads, the wait is real).
//
// A rank that waits checks every few thousand spins that its peers' processes still run (/proc), and raises when one
// is gone (the replica then dies as one); after a short spin it yields the core between checks (on a host with
// fewer cores than ranks and servicer threads, a spinning rank would otherwise hold the core its peer needs).
#include "torch_lite.h"

#include <cstdio>
#include <cstring>
#include <sched.h>
#include <immintrin.h>
#include "avx512_math.h"

namespace {

constexpr int64_t LINE = 128;    // bytes of header per rank (two cache lines: no false sharing)
constexpr int64_t HEADER = 4096;  // the data buffers start here
constexpr int64_t SPIN_BEFORE_YIELD = 1 << 14;
constexpr int64_t CHECK_EVERY = 1 << 12;

struct RankLine {
  int64_t seq;  // the last round this rank published
  int64_t pid;  // its process
};

// Whether a process is gone: no /proc entry, or a zombie (a dead child its parent has not reaped yet, which kill(pid,
// 0) would still find).
bool gone(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // the state follows the command name, which may hold spaces
  return close == nullptr || close[1] == 0 || close[2] == 'Z' || close[2] == 'X';
}

inline RankLine* line_of(uint8_t* base, int64_t rank) { return reinterpret_cast<RankLine*>(base + rank * LINE); }

inline uint8_t* buffer_of(uint8_t* base, int64_t rank, int64_t parity, int64_t cap) {
  return base + HEADER + (rank * 2 + parity) * cap;
}

void wait_for(uint8_t* base, int64_t rank, int64_t world, int64_t seq) {
  for (int64_t p = 0; p < world; ++p) {
    if (p == rank) continue;
    RankLine* peer = line_of(base, p);
    int64_t spins = 0;
    while (__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE) < seq) {
      ++spins;
      if (spins < SPIN_BEFORE_YIELD) {
        _mm_pause();
      } else {
        sched_yield();
      }
      if (spins % CHECK_EVERY == 0) {
        const int64_t pid = __atomic_load_n(&peer->pid, __ATOMIC_RELAXED);
        if (pid > 0 && gone(pid)) {
          TORCH_CHECK(false, "tensor-parallel rank ", p, " (pid ", pid, ") died");
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// 16 values at a time, added in the same order as the scalar loop (so the bits are the same whichever path a value
// takes); bfloat16 widened by a shift and narrowed with round-to-nearest-even, as c10::BFloat16 does.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return bf16x16::load(reinterpret_cast<const uint16_t*>(p)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) { bf16x16::store(reinterpret_cast<uint16_t*>(p), v); }
#endif

template <typename T>
void reduce_into(T* out, uint8_t* base, int64_t world, int64_t parity, int64_t cap, int64_t n) {
  const T* bufs[64];
  for (int64_t p = 0; p < world; ++p) bufs[p] = reinterpret_cast<const T*>(buffer_of(base, p, parity, cap));
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 s = load16(bufs[0] + i);
    for (int64_t p = 1; p < world; ++p) s = _mm512_add_ps(s, load16(bufs[p] + i));
    store16(out + i, s);
  }
#endif
  for (; i < n; ++i) {
    float s = static_cast<float>(bufs[0][i]);
    for (int64_t p = 1; p < world; ++p) s += static_cast<float>(bufs[p][i]);
    out[i] = static_cast<T>(s);
  }
}

// The checks both collectives make of their group.
void check_group(const torch::Tensor& region, int64_t rank, int64_t world, int64_t cap, const char* what) {
  TORCH_CHECK(world >= 1 && world <= 64 && rank >= 0 && rank < world, what, ": bad rank or world");
  TORCH_CHECK(region.numel() >= HEADER + world * 2 * cap && world * LINE <= HEADER, what, ": region too small");
}

// One round's start on this rank: once every rank has read the round before the last (whose buffer this round
// reuses), copy nbytes of src into this rank's buffer of the round's parity and publish the round.
void post(uint8_t* base, int64_t rank, int64_t world, int64_t seq, int64_t cap, const uint8_t* src, int64_t nbytes) {
  wait_for(base, rank, world, seq - 1);
  if (nbytes > 0) std::memcpy(buffer_of(base, rank, seq & 1, cap), src, nbytes);
  __atomic_store_n(&line_of(base, rank)->seq, seq, __ATOMIC_RELEASE);
}

}  // namespace

// Register this rank's pid in the header (the others' liveness checks read it).
void join(torch::Tensor region, int64_t rank, int64_t pid) {
  uint8_t* base = region.data_ptr<uint8_t>();
  __atomic_store_n(&line_of(base, rank)->pid, pid, __ATOMIC_RELEASE);
}

// x (float32 or bfloat16, contiguous) <- the sum of every rank's x; seq: this call's first round number (the
// rank's count of rounds so far + 1). Tensors larger than cap bytes go in several rounds. Returns the last round.
int64_t all_reduce_(torch::Tensor x, torch::Tensor region, int64_t rank, int64_t world, int64_t seq, int64_t cap) {
  TORCH_CHECK(x.is_contiguous(), "all_reduce_: x must be contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "all_reduce_: float32 or bfloat16 only");
  check_group(region, rank, world, cap, "all_reduce_");
  uint8_t* base = region.data_ptr<uint8_t>();
  const int64_t esize = x.element_size();
  const int64_t per_round = cap / esize;
  uint8_t* data = static_cast<uint8_t*>(x.data_ptr());
  const int64_t total = x.numel();
  int64_t done = 0;
  --seq;
  do {
    ++seq;
    const int64_t n = std::min(per_round, total - done);
    const int64_t parity = seq & 1;
    post(base, rank, world, seq, cap, data + done * esize, n * esize);
    wait_for(base, rank, world, seq);
    if (x.scalar_type() == torch::kFloat) {
      reduce_into(reinterpret_cast<float*>(data) + done, base, world, parity, cap, n);
    } else {
      reduce_into(reinterpret_cast<c10::BFloat16*>(data) + done, base, world, parity, cap, n);
    }
    done += n;
  } while (done < total);
  return seq;
}

// Rank 0's out [rows, sum of widths] <- every rank's x [rows, widths[rank]] side by side, in rank order (the
// logits of a vocabulary split over the ranks); out is ignored on the other ranks, which do not wait for the
// result. Rows go in as many rounds as cap needs. Returns the last round.
int64_t gather_columns_(torch::Tensor x, torch::Tensor out, torch::Tensor region, int64_t rank, int64_t world,
                        int64_t seq, int64_t cap, std::vector<int64_t> widths) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "gather_columns_: x must be a contiguous matrix");
  check_group(region, rank, world, cap, "gather_columns_");
  TORCH_CHECK(static_cast<int64_t>(widths.size()) == world && x.size(1) == widths[rank],
              "gather_columns_: widths do not agree");
  uint8_t* base = region.data_ptr<uint8_t>();
  const int64_t esize = x.element_size(), rows = x.size(0);
  int64_t max_w = 0, total_w = 0;
  for (int64_t w : widths) {
    max_w = std::max(max_w, w);
    total_w += w;
  }
  TORCH_CHECK(max_w * esize <= cap, "gather_columns_: a row is larger than the buffer");
  if (rank == 0) {
    TORCH_CHECK(out.is_contiguous() && out.size(0) == rows && out.size(1) == total_w &&
                out.scalar_type() == x.scalar_type(), "gather_columns_: out does not agree");
  }
  const int64_t per_round = cap / (max_w * esize);
  const uint8_t* src = static_cast<const uint8_t*>(x.data_ptr());
  uint8_t* dst = rank == 0 ? static_cast<uint8_t*>(out.data_ptr()) : nullptr;
  int64_t done = 0;
  --seq;
  do {
    ++seq;
    const int64_t n = std::min(per_round, rows - done);
    const int64_t parity = seq & 1;
    const int64_t row_bytes = widths[rank] * esize;  // rank 0 reads its own rows in place: it posts no bytes
    post(base, rank, world, seq, cap, src + done * row_bytes, rank == 0 ? 0 : n * row_bytes);
    if (rank == 0) {
      wait_for(base, rank, world, seq);
      int64_t col = 0;
      for (int64_t p = 0; p < world; ++p) {
        const int64_t w = widths[p] * esize;
        const uint8_t* from = p == 0 ? src + done * w : buffer_of(base, p, parity, cap);
        for (int64_t i = 0; i < n; ++i) {
          std::memcpy(dst + ((done + i) * total_w + col) * esize, from + i * w, w);
        }
        col += widths[p];
      }
    }
    done += n;
  } while (done < rows);
  return seq;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("join", &join, "register this rank's pid in the group's header");
  m.def("all_reduce_", &all_reduce_, "sum x over the group's ranks in place (shared memory); returns the last round");
  m.def("gather_columns_", &gather_columns_, "rank 0's out <- every rank's columns side by side; returns the last round");
}
