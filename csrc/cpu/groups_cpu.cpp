// accumulate_groups on the CPU. Groups whose slices are long contiguous runs
// (experts along a leading dimension) read through a view per group with the
// statistics op's loop. Groups of short runs (heads: 64 values of every
// token) are walked in tiles of consecutive rows, each group's runs of a tile
// pushed to that group's partial statistics (Partial, stats_cpu.h): read in
// place as rows when the run is a multiple of 16 values (the loop's
// kWalkRows), else copied into one L1-sized buffer first.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/stats_cpu.h"
#include "hookcap/dtype_load.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"

namespace hookcap {
namespace {

// Values per push: enough that each push's fixed cost is amortised, few
// enough that a copied tile stays in L1 (written, then read by the push).
constexpr int64_t kGatherTile = 2048;
constexpr int64_t kGatherTileInPlace = 4096;  // read in place: no buffer to keep in L1
constexpr int64_t kGatherRunBelow = 4096;  // runs shorter than this are walked by tiles
constexpr int64_t kGatherGroups = 64;      // at most this many groups (partials per thread)

// One thread's buffer and partials for every group, reused between calls.
struct GatherState {
  std::vector<char> buf;         // one tile of one group's runs, copied
  std::vector<uint32_t> local;   // groups x kPartialLocalWords
  std::vector<Partial> part;
};

// `rows` runs of `run` values, `step` apart from `x`, into `out` back to back
// (as float, or double for double input: exact). Built for the baseline ISA
// and for AVX2 (twice the width), picked once per call.
template <typename T, typename V>
C10_ALWAYS_INLINE void copy_runs(const T* x, int64_t rows, int64_t step, int64_t run, V* __restrict out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* __restrict from = x + r * step;
    V* __restrict to = out + r * run;
    if constexpr (std::is_same_v<T, V>) {
      std::memcpy(to, from, sizeof(V) * run);
    } else {
      for (int64_t i = 0; i < run; ++i) to[i] = load_float(from + i);
    }
  }
}

template <typename T, typename V>
void copy_runs_base(const T* x, int64_t rows, int64_t step, int64_t run, V* out) {
  copy_runs<T, V>(x, rows, step, run, out);
}

template <typename T, typename V>
__attribute__((target("avx2,f16c"))) void copy_runs_avx2(const T* x, int64_t rows, int64_t step, int64_t run,
                                                           V* out) {
  copy_runs<T, V>(x, rows, step, run, out);
}

// x contiguous, seen as [outer, groups, run]: group g's values are the runs
// at (o * groups + g) * run. Threads take ranges of `outer`.
template <typename T>
void gather_groups(const T* x, int64_t outer, int64_t groups, int64_t run, int64_t* const* rows, const HistSpec& h) {
  using V = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const bool avx2 = cpu_avx2();
  const bool in_place = rows_run_ok(run);
  // Tiles of `tile` consecutive outer rows: each group's runs of a tile are
  // pushed whole (copied first into one buffer of `tile * run` values,
  // reused by every group, unless read in place). The tile's lines are read
  // once, one group's at a time.
  const int64_t tile = std::max<int64_t>(1, (in_place ? kGatherTileInPlace : kGatherTile) / run);
  at::parallel_for(0, outer, std::max<int64_t>(tile, 32768 / (run * groups)),
                   [&](int64_t o0, int64_t o1) {
    thread_local GatherState s;
    s.buf.resize(sizeof(V) * tile * run);
    s.local.resize(groups * kPartialLocalWords);
    s.part.resize(groups);
    // The loop kind follows T's working precision, which its copies V share.
    for (int64_t g = 0; g < groups; ++g) {
      if (rows[g]) partial_begin<T>(s.part[g], rows[g], h, s.local.data() + g * kPartialLocalWords);
    }
    V* __restrict b = reinterpret_cast<V*>(s.buf.data());
    for (int64_t t0 = o0; t0 < o1; t0 += tile) {
      const int64_t t1 = std::min(o1, t0 + tile);
      for (int64_t g = 0; g < groups; ++g) {
        if (!rows[g]) continue;
        const T* from = x + (t0 * groups + g) * run;
        if (in_place) {
          // A full next tile: each group's pass fetches its share of it into
          // L2 in address order (runs of a few lines, `groups` apart, escape
          // the hardware's stream prefetch), and its own rows a few ahead
          // into L1; else this group's runs of the next tile.
          const bool full = t1 + tile <= o1;
          const char* seq = full ? reinterpret_cast<const char*>(x + t1 * groups * run) +
                                       g * (t1 - t0) * run * static_cast<int64_t>(sizeof(T))
                                 : nullptr;
          partial_push_rows<T>(s.part[g], from, t1 - t0, groups * run, run, t1 < o1 ? tile * groups * run : 0, seq);
          continue;
        }
        if (avx2) {
          copy_runs_avx2<T, V>(from, t1 - t0, groups * run, run, b);
        } else {
          copy_runs_base<T, V>(from, t1 - t0, groups * run, run, b);
        }
        partial_push<V>(s.part[g], b, (t1 - t0) * run);
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      if (rows[g]) partial_flush(s.part[g]);
    }
  });
}

void accumulate_groups_cpu(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                           int64_t dim, int64_t size, int64_t hist_kind, double hist_lo, double hist_hi,
                           int64_t hist_bins) {
  check_groups(x, ring, state, rows, dim, size);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  const int64_t* st = state.data_ptr<int64_t>();
  if (st[kStateEnabled] == 0) return;
  const int64_t slot = state_slot(ring, st);
  const int64_t groups = static_cast<int64_t>(rows.size());
  const int64_t per_group = groups ? x.numel() / groups : 0;
  std::vector<int64_t*> row_of(groups, nullptr);
  for (int64_t g = 0; g < groups; ++g) {
    if (rows[g] >= 0) row_of[g] = counted_row(ring, slot, rows[g], per_group);
  }
  if (per_group == 0) return;
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  int64_t inner = 1;
  for (int64_t i = d + 1; i < x.dim(); ++i) inner *= x.size(i);
  const int64_t run = size * inner;  // contiguous values of a group per outer index
  // moments=4 needs the statistics op's own loop (the produced-values
  // partials keep two moments).
  if (x.is_contiguous() && run < kGatherRunBelow && groups <= kGatherGroups && !h.moments4) {
    const int64_t outer = x.numel() / (groups * run);
    AT_DISPATCH_FLOATING_TYPES_AND4(at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, x.scalar_type(),
                                    "hookcap_groups_cpu", [&] {
      gather_groups<scalar_t>(x.const_data_ptr<scalar_t>(), outer, groups, run, row_of.data(), h);
    });
    return;
  }
  auto one = [&](int64_t g) {
    if (row_of[g]) accumulate_tensor_cpu(x.narrow(dim, g * size, size), row_of[g], h);
  };
  if (groups >= at::get_num_threads()) {
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) one(g);  // the loop inside runs on this thread
    });
  } else {
    for (int64_t g = 0; g < groups; ++g) one(g);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hookcap, CPU, m) { m.impl("accumulate_groups", &accumulate_groups_cpu); }

}  // namespace hookcap
