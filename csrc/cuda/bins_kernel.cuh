// accumulate_bins' CUDA kernel: each element of an integer index tensor (a
// router's top-k expert choices) adds its value (its weight, or 1) to the row
// of the bin it names (bins_math.h). Plain CUDA C++, compiled by nvcc
// (stats_launch.cu) and by the CPU emulation harness (tests/cuda_emu).
//
// Index tensors are small (tokens x k: a few MB at most), so the kernel is
// simple rather than tuned: grid.y takes one bin each, grid.x strides over
// the elements, and each block keeps the values naming its bin, in double,
// with one merge into the ring per block. Every bin's blocks read the whole
// index tensor (bins x its bytes, from L2 after the first).
#pragma once

#include "cuda/stats_kernel.cuh"
#include "hookcap/bins_math.h"

namespace hookcap {
namespace kernels {

// The rows of the launch's bins (grid.y), -1: not recorded.
struct BinsRows {
  int32_t row[kBinsPerLaunch];
};

// Shared-memory histogram counters per block (more bins count straight into the ring).
constexpr int64_t kBinsSmemBins = 2048;

// Dynamic shared memory: the row's shift, each warp's partial and count, then the counters.
C10_HOST_DEVICE constexpr int64_t bins_acc_offset() { return 16; }
C10_HOST_DEVICE constexpr int64_t bins_count_offset() {
  return bins_acc_offset() + kWarps * static_cast<int64_t>(sizeof(Acc));
}
C10_HOST_DEVICE constexpr int64_t bins_hist_offset() { return bins_count_offset() + kWarps * 8; }
inline int64_t bins_smem_bytes(int64_t nbins) {
  return bins_hist_offset() + (nbins > 0 && nbins <= kBinsSmemBins ? nbins * 4 : 0);
}

// bin0: the launch's first bin; bins: all bins (an index >= bins is in none).
template <typename I, typename W>
__global__ void __launch_bounds__(kThreads)
    bins_kernel(const I* index, const W* weight, int64_t n, BinsRows r, int64_t bin0, int64_t bins,
                int64_t* ring, const int64_t* state, int64_t slots, int64_t rows, int64_t width, HistSpec h) {
  if (state[kStateEnabled] == 0) return;
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // same guard as the stats kernels
  const int32_t row_id = r.row[blockIdx.y];
  if (row_id < 0) return;
  const int64_t bin = bin0 + static_cast<int64_t>(blockIdx.y);
  int64_t* out = ring + (slot * rows + row_id) * width;
  unsigned char* smem = dynamic_smem();
  double* s_shift = reinterpret_cast<double*>(smem);
  Acc* s_acc = reinterpret_cast<Acc*>(smem + bins_acc_offset());
  int64_t* s_count = reinterpret_cast<int64_t*>(smem + bins_count_offset());
  unsigned int* s_hist = reinterpret_cast<unsigned int*>(smem + bins_hist_offset());
  const int64_t nbins = h.kind == kHistNone ? 0 : h.nbins;
  const bool local_hist = nbins > 0 && nbins <= kBinsSmemBins;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    if (blockIdx.x == 0) DeviceAtomics::add_i64(out + kCalls, 1);
    // Every block finds the same candidate: the first writer of the row fixes it.
    const double cand = bins_shift_candidate(weight, n);
    const int64_t old = DeviceAtomics::cas_i64(out + kShift, kShiftUnset, dbits(cand));
    s_shift[0] = old == kShiftUnset ? cand : bitsd(old);
  }
  if (local_hist) {
    for (int64_t i = tid; i < nbins; i += kThreads) s_hist[i] = 0u;
  }
  __syncthreads();
  const double shift = s_shift[0];
  Acc acc;
  WideAcc wide;
  acc_init(acc);
  wide_init(wide);
  int64_t count = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + tid; i < n; i += stride) {
    if (bin_of(index[i], bins) != bin) continue;
    const double v = bins_value(weight, i);
    ++count;
    acc_push_wide(acc, wide, v, shift);
    if (nbins == 0) continue;
    const int64_t k = hist_bin(v, h);
    if (k < 0) continue;
    if (local_hist) {
      atomicAdd(s_hist + k, 1u);
    } else {
      DeviceAtomics::add_i64(out + kHeader + k, 1);
    }
  }
  wide_to_row<DeviceAtomics>(out, wide, 1);  // rare values: straight from their thread
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
  warp_reduce(acc);
  for (int d = kWarpSize / 2; d > 0; d /= 2) count += shfl_down(count, d);
  if (lane == 0) {
    s_acc[warp] = acc;
    s_count[warp] = count;
  }
  __syncthreads();
  if (warp == 0) {
    Acc a;
    int64_t c = 0;
    if (lane < kWarps) {
      a = s_acc[lane];
      c = s_count[lane];
    } else {
      acc_init(a);
    }
    warp_reduce(a);
    for (int d = kWarpSize / 2; d > 0; d /= 2) c += shfl_down(c, d);
    if (lane == 0 && c > 0) {
      DeviceAtomics::add_i64(out + kCount, c);
      row_merge<DeviceAtomics>(out, a);
    }
  }
  if (local_hist) {
    for (int64_t i = tid; i < nbins; i += kThreads) {
      if (s_hist[i] != 0u) DeviceAtomics::add_i64(out + kHeader + i, s_hist[i]);
    }
  }
}

// The launches of `bins` bins (rows[b], -1: not recorded), as the launcher
// and the harness make them: fn(BinsRows, first bin, bins in the launch).
template <typename Fn>
inline void for_bins_launch(const int64_t* rows, int64_t bins, Fn&& fn) {
  for (int64_t b0 = 0; b0 < bins; b0 += kBinsPerLaunch) {
    BinsRows r{};
    const int64_t nb = bins - b0 < kBinsPerLaunch ? bins - b0 : kBinsPerLaunch;
    for (int64_t j = 0; j < nb; ++j) r.row[j] = static_cast<int32_t>(rows[b0 + j]);
    fn(r, b0, nb);
  }
}

}  // namespace kernels
}  // namespace hookcap
