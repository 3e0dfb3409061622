// attention_rows on the CPU: rows in parallel, each read twice from cache
// (its max, then the sums about it: attention_math.h), with kLanes partial
// sums per row (vector lanes; a shorter error path than one sum), compiled
// for AVX2+FMA and for the baseline ISA, chosen at run time. Its recording
// form, accumulate_attention, pushes each few rows to their head's
// statistics while they are still in cache.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu/stats_cpu.h"
#include "hookcap/attention_math.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"

namespace hookcap {
namespace {

#define HC_ATTN_INLINE inline __attribute__((always_inline))

constexpr int kLanes = 16;

// One row: the causal mask written, then its max and its sums in kLanes
// lanes each, its last keys % kLanes logits included (the compiler
// vectorises these loops for the ISA of the function it is inlined into:
// attention_math.h's per-logit math has no branch).
// kFused: multiply-adds rounded once (the AVX2+FMA build).
template <bool kFused>
HC_ATTN_INLINE void attention_row(float* v, int64_t tk, int64_t keys, float* lse, float* entropy) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = keys; j < tk; ++j) v[j] = ninf;
  float mx[kLanes];
  for (float& m : mx) m = ninf;
  const int64_t nv = keys - keys % kLanes;
  for (int64_t j = 0; j < nv; j += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) mx[l] = logit_max(mx[l], v[j + l]);
  }
  // The last keys % kLanes logits take one more vector step, padded with
  // -inf, which changes neither the max nor any sum: short rows (a router's
  // few experts, a causal row's end) stay off the scalar path.
  float tail[kLanes];
  const bool has_tail = nv < keys;
  if (has_tail) {
    for (float& t : tail) t = ninf;
    std::memcpy(tail, v + nv, sizeof(float) * static_cast<size_t>(keys - nv));
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) mx[l] = logit_max(mx[l], tail[l]);
  }
  float m = mx[0];
  for (int l = 1; l < kLanes; ++l) m = logit_max(m, mx[l]);
  SoftmaxSums s = softmax_sums_zero();
  if (m - m == 0.f) {  // finite: softmax_finish settles the rest
    float others[kLanes] = {}, ties[kLanes] = {}, t[kLanes] = {};
    for (int64_t j = 0; j < nv; j += kLanes) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) softmax_push<kFused>(others[l], ties[l], t[l], v[j + l], m);
    }
    if (has_tail) {
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) softmax_push<kFused>(others[l], ties[l], t[l], tail[l], m);
    }
    for (int w = kLanes / 2; w > 0; w /= 2) {  // pairwise
      for (int l = 0; l < w; ++l) {
        others[l] += others[l + w];
        ties[l] += ties[l + w];
        t[l] += t[l + w];
      }
    }
    s = SoftmaxSums{others[0], ties[0], t[0]};
  }
  softmax_finish(m, s, lse, entropy);
}

__attribute__((target("avx2,fma"))) void rows_avx2(float* x, int64_t r0, int64_t r1, int64_t tile_rows, int64_t tk,
                                                   int64_t causal_row0, float* lse, float* entropy) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t keys = causal_keys(causal_row0 + r % tile_rows, tk, causal_row0 >= 0);
    attention_row<true>(x + r * tk, tk, keys, lse + r, entropy + r);
  }
}

void rows_baseline(float* x, int64_t r0, int64_t r1, int64_t tile_rows, int64_t tk, int64_t causal_row0,
                   float* lse, float* entropy) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t keys = causal_keys(causal_row0 + r % tile_rows, tk, causal_row0 >= 0);
    attention_row<false>(x + r * tk, tk, keys, lse + r, entropy + r);
  }
}

// Rows [r0, r1) of x, with the statistics loop's ISA choice
// (HOOKCAP_CPU_ISA=baseline forces the baseline build).
void attention_rows_of(float* x, int64_t r0, int64_t r1, int64_t tile_rows, int64_t tk, int64_t causal_row0,
                       float* lse, float* entropy) {
  (cpu_avx2() ? rows_avx2 : rows_baseline)(x, r0, r1, tile_rows, tk, causal_row0, lse, entropy);
}

std::tuple<at::Tensor, at::Tensor> attention_rows_cpu(at::Tensor& logits, int64_t causal_row0) {
  AttentionRows a = attention_rows_outputs(logits, causal_row0);
  if (a.rows == 0) return {a.lse, a.entropy};
  float* x = logits.data_ptr<float>();
  float* pl = a.lse.data_ptr<float>();
  float* pe = a.entropy.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, a.keys));
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    attention_rows_of(x, r0, r1, a.tile_rows, a.keys, causal_row0, pl, pe);
  });
  return {a.lse, a.entropy};
}

// Logits pushed per call: enough to amortise a push, few enough that the
// rows just computed are still in L1/L2 when the statistics read them.
constexpr int64_t kRecordChunk = 4096;

// One thread's rows of a [batch, head] block: lse and entropy, and the
// three partials' local histograms.
struct RecordState {
  std::vector<float> lse, entropy;
  std::vector<uint32_t> local;
};

// attention_rows, then each head's logits, lse and entropy merged into its
// rows (count and calls added here, as accumulate_groups does). Threads
// take [batch, head] blocks: each block's rows are computed a chunk at a
// time and the chunk pushed to the head's logit partial from cache.
void accumulate_attention_cpu(at::Tensor& logits, int64_t causal_row0, at::Tensor& ring, const at::Tensor& state,
                              c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows, c10::IntArrayRef entropy_rows,
                              int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_attention_record(logits, causal_row0, ring, state, logit_rows, lse_rows, entropy_rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  const int64_t batch = logits.size(0), heads = logits.size(1), rows = logits.size(2), keys = logits.size(3);
  // Per metric (logit, lse, entropy) and head: its row, or null.
  std::vector<int64_t*> row_of(3 * heads, nullptr);
  const c10::IntArrayRef lists[3] = {logit_rows, lse_rows, entropy_rows};
  const int64_t counts[3] = {batch * rows * keys, batch * rows, batch * rows};
  for (int m = 0; m < 3; ++m) {
    for (int64_t g = 0; g < heads; ++g) {
      if (lists[m][g] >= 0) row_of[m * heads + g] = counted_row(ring, slot, lists[m][g], counts[m]);
    }
  }
  if (batch * heads * rows == 0) return;
  if (h.moments4) {  // the partials keep two moments: the statistics op's own loop over each head's views
    const auto [lse, entropy] = attention_rows_cpu(logits, causal_row0);
    const at::Tensor* of[3] = {&logits, &lse, &entropy};
    for (int m = 0; m < 3; ++m) {
      for (int64_t g = 0; g < heads; ++g) {
        if (row_of[m * heads + g]) accumulate_tensor_cpu(of[m]->narrow(1, g, 1), row_of[m * heads + g], h);
      }
    }
    return;
  }
  float* x = logits.data_ptr<float>();
  const int64_t chunk = std::max<int64_t>(1, kRecordChunk / std::max<int64_t>(1, keys));
  // Blocks in head-major order: a thread's consecutive blocks mostly share
  // a head, whose three partials stay open across them (one begin and one
  // flush per head and thread, not per block).
  at::parallel_for(0, batch * heads, 1, [&](int64_t b0, int64_t b1) {
    thread_local RecordState s;
    s.lse.resize(rows);
    s.entropy.resize(rows);
    s.local.resize(3 * kPartialLocalWords);
    Partial part[3];
    int64_t open = -1;  // the head whose partials are open
    auto close = [&] {
      for (int m = 0; m < 3 && open >= 0; ++m) {
        if (row_of[m * heads + open]) partial_flush(part[m]);
      }
      open = -1;
    };
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t g = blk / batch, b = blk % batch;
      int64_t* const* row = row_of.data() + g;  // row[m * heads]: metric m's
      if (g != open) {
        close();
        for (int m = 0; m < 3; ++m) {
          if (row[m * heads]) partial_begin<float>(part[m], row[m * heads], h, s.local.data() + m * kPartialLocalWords);
        }
        open = g;
      }
      float* base = x + (b * heads + g) * rows * keys;
      for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t r1 = std::min(rows, r0 + chunk);
        attention_rows_of(base, r0, r1, rows, keys, causal_row0, s.lse.data(), s.entropy.data());
        if (row[0]) partial_push<float>(part[0], base + r0 * keys, (r1 - r0) * keys);
      }
      if (row[heads]) partial_push<float>(part[1], s.lse.data(), rows);
      if (row[2 * heads]) partial_push<float>(part[2], s.entropy.data(), rows);
    }
    close();
  });
}

// attention_qk has no CPU kernel: on the CPU the attention capture computes
// tiles of logits and accumulate_attention reads each few rows from cache.
void attention_qk_cpu(const at::Tensor&, const at::Tensor&, bool, double, at::Tensor&, const at::Tensor&,
                      c10::IntArrayRef, c10::IntArrayRef, c10::IntArrayRef, int64_t, double, double, int64_t) {
  TORCH_CHECK(false, "hookcap.attention_qk runs on CUDA tensors only (attention_qk_supported); on the CPU, "
              "accumulate_attention takes tiles of logits");
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) {
  m.impl("attention_rows", &attention_rows_cpu);
  m.impl("accumulate_attention", &accumulate_attention_cpu);
  m.impl("attention_qk", &attention_qk_cpu);
}

}  // namespace hookcap
