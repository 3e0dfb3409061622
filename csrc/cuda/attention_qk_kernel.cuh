// attention_qk_kernel: the attention capture's whole observation of one
// F.scaled_dot_product_attention call from its 16-bit q and k, with no
// logits in global memory. A block takes kQkRows query rows of one
// (batch, head) and walks the keys in tiles of kQkKeys: each tile of logits
// q.k^T (tensor cores, mma_shim.cuh) lives in shared memory only, read by
// the block's threads, in one walk, for the statistics of the allowed
// logits (the statistics kernel's float runs, flushes and histogram,
// stats_math.h) and each row's softmax sums about its running max, rebased
// as it grows (attention_math.h), hence the row's logsumexp and entropy,
// written to global memory (kQkRows floats each) for the grouped launches.
// Keys a top-left causal mask hides are counted as -inf (the tiled path's
// neginf) and never computed. Plain CUDA C++, compiled by nvcc
// (stats_launch.cu) and by the CPU emulation harness (tests/cuda_emu).
#pragma once

#include "cuda/mma_shim.cuh"
#include "hookcap/attention_qk.h"
#include "cuda/stats_kernel.cuh"
#include "hookcap/attention_math.h"

namespace hookcap {
namespace kernels {

static_assert(kThreads == 256 && kWarps == 8, "8 warps: 4 row blocks of 16 rows x 2 halves of a key tile");

// Three blocks per SM (at most 85 registers: ptxas picks 80): unbounded,
// ptxas gives bfloat16 with log2 on sm_90 101, which leaves room for two.
template <typename T, int kMode>
__global__ void __launch_bounds__(kThreads, 3)
    attention_qk_kernel(QkArgs a, QkRows rows, RowTarget tgt, HistSpec hist) {
  static_assert(kMode == kModeNone || kMode == kModeLog2Exp, "the launcher offers these two histograms");
  __shared__ std::conditional_t<kMode == kModeLog2Exp, Log2ExpSmem, char> sh;
  __shared__ Acc s_warp[kWarps];
  __shared__ int64_t s_shift[kWarps];

  if (blockDim.x != kThreads) __trap();
  const int64_t slot = tgt.state[kStateSlot];
  if (tgt.state[kStateEnabled] == 0 || slot < 0 || slot >= tgt.slots) return;  // off-step or corrupt: uniform
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int64_t bh = blockIdx.y, b = bh / a.heads;
  const int h = static_cast<int>(bh % a.heads);
  const int hk = h / (a.heads / a.kv_heads);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kQkRows;
  const int d = a.d, ld = d + kQkPad;

  unsigned char* smem = dynamic_smem();
  smem += (128 - reinterpret_cast<uintptr_t>(smem) % 128) % 128;  // wmma tiles: 32-byte aligned rows
  T* qs = reinterpret_cast<T*>(smem);
  T* ks = qs + kQkRows * ld;
  float* s = reinterpret_cast<float*>(ks + kQkKeys * ld);
  float* s_max = s + kQkRows * kQkLds;  // [2][kQkRows]: each key half's row max
  float* s_sums = s_max + 2 * kQkRows;  // [2][kQkRows][3]: each key half's SoftmaxSums

  // 16-byte vectors of tile rows from global memory (zeros past the end).
  const int vecs = d / 8;
  auto load_rows = [&](T* dst, const T* src, int64_t first, int64_t end, int64_t stride) {
    for (int i = tid; i < kQkRows * vecs; i += kThreads) {
      const int r = i / vecs, c = i % vecs;
      Words16 w{{0u, 0u, 0u, 0u}};
      if (first + r < end) w = load16(src + (first + r) * stride + c * 8);
      *reinterpret_cast<Words16*>(dst + r * ld + c * 8) = w;
    }
  };
  const T* qg = static_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
  const T* kg = static_cast<const T*>(a.k) + b * a.k_sb + hk * a.k_sh;
  load_rows(qs, qg, q0, a.tq, a.q_st);

  if constexpr (kMode == kModeLog2Exp) {
    for (int i = tid; i < kWarps * 256; i += kThreads) (&sh.tab[0][0])[i] = 0u;
  }
  SmemAddr warp_tab = 0;
  if constexpr (kMode == kModeLog2Exp) warp_tab = smem_addr(&sh.tab[warp][0]);

  // This lane's share of every tile: row rl, keys [c0, c0 + 16) of the tile.
  const int rb = warp % 4, kh = warp / 4;
  const int rl = 16 * rb + lane / 2, c0 = 32 * kh + 16 * (lane % 2);
  const int64_t qi = q0 + rl;
  const int64_t allowed = qi < a.tq ? causal_keys(qi, a.tk, a.causal) : 0;  // keys this row sees
  const int64_t last_q = (q0 + kQkRows < a.tq ? q0 + kQkRows : a.tq) - 1;
  const int64_t keys_end = causal_keys(last_q, a.tk, a.causal);  // keys any row of the block sees
  const float* srow = s + rl * kQkLds + c0;

  // One tile of logits into s: every thread calls it (barriers inside).
  auto tile = [&](int64_t kt0) {
    __syncthreads();  // the previous tile's reads of ks and s are done
    load_rows(ks, kg, kt0, a.tk, a.k_st);
    __syncthreads();
    for (int n = 0; n < 2; ++n) {
      warp_mma_abt(qs + 16 * rb * ld, ld, ks + (32 * kh + 16 * n) * ld, ld, d,
                   s + 16 * rb * kQkLds + 32 * kh + 16 * n, kQkLds);
    }
  };
  const bool stats = rows.row[h] >= 0;
  int64_t* row = tgt.ring + (slot * tgt.rows + (stats ? rows.row[h] : 0)) * tgt.width;

  // One walk over the tiles: the logits' statistics, as the statistics
  // kernel's runs (a run: this lane's allowed logits of one tile), and this
  // lane's softmax sums about its running max, rebased when a tile raises it
  // (online softmax: the product is computed once).
  ThreadAcc<float> part;
  thread_acc_init(part);
  double shift = 0.0;
  bool has_shift = false;
  float c = 0.f;  // the next run's center
  float lm = -__builtin_huge_valf();  // this lane's max so far
  SoftmaxSums ss = softmax_sums_zero();
  auto exact = [&](double v) {
    if (!has_shift && (v < 0 ? -v : v) < kInf) {
      shift = v;
      has_shift = true;
    }
    thread_acc_push(part, v, shift);
  };
  for (int64_t kt0 = 0; kt0 < keys_end; kt0 += kQkKeys) {
    tile(kt0);
    const int64_t mine = allowed - (kt0 + c0);  // this lane's allowed keys in the tile: the first `mine`
    const int m = mine <= 0 ? 0 : mine >= 16 ? 16 : static_cast<int>(mine);
    float tm = lm;
    for (int j = 0; j < m; ++j) tm = logit_max(tm, srow[j] * a.scale);
    softmax_rebase(ss, lm, tm);
    lm = tm;
    // About a max of -inf (nothing yet), NaN or +inf (the row is NaN by
    // softmax_finish) a push adds nothing that matters: no test per logit.
    float s1 = 0.f, s2 = 0.f, mn = kInfF, mx = -kInfF, nz = 0.f;
    for (int j = 0; j < m; ++j) {
      const float v = srow[j] * a.scale;
      const float dv = v - c;
      s1 += dv;
      s2 = FmaSquare{}(s2, dv);
      mn = wmin(mn, v);
      mx = wmax(mx, v);
      nz += v == 0.f ? 1.f : 0.f;
      softmax_push(ss, v, lm);
      if constexpr (kMode == kModeLog2Exp) {
        if (stats) atomicAdd(smem_ptr<unsigned int>(((vbits(v) >> 21) & 0x3fcu) | warp_tab), 1u);
      }
    }
    if (m == 0 || !stats) continue;
    const bool finite = s2 - s2 == 0.f;  // false iff a NaN/Inf (or an overflowing square)
    if (finite && !shift_well_conditioned(s1, s2, m)) {
      c = c + s1 / static_cast<float>(m);  // again about the run's mean, from shared memory
      s1 = s2 = 0.f;
      for (int j = 0; j < m; ++j) push_shifted(srow[j] * a.scale, c, s1, s2, FmaSquare{});
    }
    if (finite && float_sums_ok(s1, s2, mn, mx)) {
      if (!has_shift) {
        shift = static_cast<double>(c);
        has_shift = true;
      }
      thread_acc_add_run(part, s1, s2, m, c, shift, mn, mx, static_cast<uint32_t>(nz));
      c = next_center(c, s1, s2, m);
    } else {
      for (int j = 0; j < m; ++j) exact(static_cast<double>(srow[j] * a.scale));  // rare: in double
    }
  }
  // The row's four partials (two lanes x two key halves) about its max.
  {
    const SoftmaxSums o{__shfl_xor_sync(0xffffffffu, ss.others, 1), __shfl_xor_sync(0xffffffffu, ss.ties, 1),
                        __shfl_xor_sync(0xffffffffu, ss.t, 1)};
    softmax_merge_about(lm, ss, __shfl_xor_sync(0xffffffffu, lm, 1), o);
  }
  if (lane % 2 == 0) {
    s_max[kh * kQkRows + rl] = lm;
    float* o = s_sums + (kh * kQkRows + rl) * 3;
    o[0] = ss.others;
    o[1] = ss.ties;
    o[2] = ss.t;
  }
  __syncthreads();
  if (tid < kQkRows && q0 + tid < a.tq) {
    const float* lo = s_sums + tid * 3;
    const float* hi = s_sums + (kQkRows + tid) * 3;
    float rm = s_max[tid];
    SoftmaxSums t{lo[0], lo[1], lo[2]};
    softmax_merge_about(rm, t, s_max[kQkRows + tid], SoftmaxSums{hi[0], hi[1], hi[2]});
    const int64_t at = bh * a.tq + q0 + tid;
    softmax_finish(rm, t, a.lse + at, a.entropy + at);
  }
  if (!stats) return;  // uniform

  // The keys the mask hides, as the tiled path's -inf logits: counted only.
  if (tid < kQkRows && q0 + tid < a.tq) {
    part.nninf += static_cast<uint32_t>(a.tk - causal_keys(q0 + tid, a.tk, a.causal));
  }
  // The block's partial and counts into the head's row, as accumulate_kernel's end.
  Acc acc = to_acc(part, shift);
  warp_common_shift(acc, has_shift, shift);
  warp_reduce(acc);
  if (lane == 0) {
    s_warp[warp] = acc;
    s_shift[warp] = has_shift ? dbits(shift) : kShiftUnset;
  }
  __syncthreads();
  if (warp == 0) {
    const bool have = lane < kWarps && s_shift[lane] != kShiftUnset;
    shift = have ? bitsd(s_shift[lane]) : 0.0;
    if (lane < kWarps) {
      acc = s_warp[lane];
    } else {
      acc_init(acc);
    }
    has_shift = have;
    warp_common_shift(acc, has_shift, shift);
    warp_reduce(acc);
  }
  BlockCounts counts{nullptr, 0, 0, 0, 0};
  if constexpr (kMode == kModeLog2Exp) counts = BlockCounts{&sh.tab[0][0], kWarps, 256, 1, 0};
  RowTarget t = tgt;
  const bool first = blockIdx.x == 0 && b == 0;  // the head's count and call, once
  t.count = first ? tgt.count : 0;
  t.calls = first ? tgt.calls : 0;
  Moments4 q4;
  moments4_init(q4);
  // block_epilogue adds count and calls from blockIdx.x == 0 only: blocks
  // of other batch entries pass none.
  block_epilogue<kMode, false, false>(acc, has_shift, shift, t, hist, row, counts, q4);
}

// The kernel for 16-bit q, k (bfloat16 or float16) and the histogram.
using QkKernel = void (*)(QkArgs, QkRows, RowTarget, HistSpec);
inline QkKernel attention_qk_kernel_for(bool bf16, bool log2) {
  if (bf16) return log2 ? &attention_qk_kernel<c10::BFloat16, kModeLog2Exp> : &attention_qk_kernel<c10::BFloat16, kModeNone>;
  return log2 ? &attention_qk_kernel<c10::Half, kModeLog2Exp> : &attention_qk_kernel<c10::Half, kModeNone>;
}

}  // namespace kernels
}  // namespace hookcap
