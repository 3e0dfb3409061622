// accumulate_groups on the CPU. Groups whose slices are long contiguous runs
// (experts along a leading dimension) read through a view per group with the
// statistics op's loop. Groups of short runs (heads: 64 values of every
// token) are gathered instead: the tensor is walked once in memory order,
// each run copied into its group's block buffer, and full blocks go to the
// float (or double) statistics loop of values produced elsewhere
// (FloatsPartial / DoublesPartial), as the update op's values do.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/stats_cpu.h"
#include "hookcap/dtype_load.h"
#include "hookcap/op_checks.h"
#include "hookcap/state.h"

namespace hookcap {
namespace {

// Values per group buffer: large enough that each push's fixed cost is
// amortised, small enough that every group's buffer stays in L2.
constexpr int64_t kGatherValues = 1 << 16;  // all groups' buffers together
inline int64_t gather_block(int64_t groups) { return std::clamp<int64_t>(kGatherValues / groups, 2048, 8192); }
constexpr int64_t kGatherRunBelow = 4096;  // runs shorter than this are gathered
constexpr int64_t kGatherGroups = 64;      // at most this many groups are gathered (buffers per thread)

// One thread's buffers and partials for every group, reused between calls.
template <typename V, typename Partial>
struct GatherState {
  std::vector<V> buf;            // groups x gather_block(groups)
  std::vector<int64_t> fill;     // values waiting per group
  std::vector<uint32_t> local;   // groups x kDoublesLocalWords
  std::vector<Partial> part;
};

template <typename V>
using PartialOf = std::conditional_t<std::is_same_v<V, double>, DoublesPartial, FloatsPartial>;

template <typename V>
void partial_begin(PartialOf<V>& p, int64_t* row, const HistSpec& h, uint32_t* local) {
  if constexpr (std::is_same_v<V, double>) {
    doubles_begin(p, row, h, local);
  } else {
    floats_begin(p, row, h, local);
  }
}
template <typename V>
void partial_push(PartialOf<V>& p, const V* x, int64_t n) {
  if constexpr (std::is_same_v<V, double>) {
    doubles_push(p, x, n);
  } else {
    floats_push(p, x, n);
  }
}
template <typename V>
void partial_flush(PartialOf<V>& p) {
  if constexpr (std::is_same_v<V, double>) {
    doubles_flush(p);
  } else {
    floats_flush(p);
  }
}

// x contiguous, seen as [outer, groups, run]: group g's values are the runs
// at (o * groups + g) * run. Threads take ranges of `outer`.
template <typename T>
void gather_groups(const T* x, int64_t outer, int64_t groups, int64_t run, int64_t* const* rows, const HistSpec& h) {
  using V = std::conditional_t<std::is_same_v<T, double>, double, float>;
  auto value_of = [](const T* p) -> V {
    if constexpr (std::is_same_v<T, double>) {
      return *p;
    } else {
      return load_float(p);  // exact: every input dtype but double fits a float
    }
  };
  at::parallel_for(0, outer, std::max<int64_t>(1, 32768 / (run * groups)),
                   [&](int64_t o0, int64_t o1) {
    thread_local GatherState<V, PartialOf<V>> s;
    const int64_t block = gather_block(groups);
    s.buf.resize(groups * block);
    s.fill.assign(groups, 0);
    s.local.resize(groups * kDoublesLocalWords);
    s.part.resize(groups);
    for (int64_t g = 0; g < groups; ++g) {
      if (rows[g]) partial_begin<V>(s.part[g], rows[g], h, s.local.data() + g * kDoublesLocalWords);
    }
    for (int64_t o = o0; o < o1; ++o) {
      for (int64_t g = 0; g < groups; ++g) {
        if (!rows[g]) continue;
        const T* src = x + (o * groups + g) * run;
        V* b = s.buf.data() + g * block;
        int64_t done = 0, fill = s.fill[g];
        while (done < run) {
          const int64_t take = std::min(run - done, block - fill);
          V* __restrict dst = b + fill;
          const T* __restrict from = src + done;
          // An inline loop: runs are short (a head's 64 values), where a
          // memcpy call costs more than the copy.
          for (int64_t i = 0; i < take; ++i) dst[i] = value_of(from + i);
          fill += take;
          done += take;
          if (fill == block) {
            partial_push<V>(s.part[g], b, block);
            fill = 0;
          }
        }
        s.fill[g] = fill;
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      if (!rows[g]) continue;
      if (s.fill[g]) partial_push<V>(s.part[g], s.buf.data() + g * block, s.fill[g]);
      partial_flush<V>(s.part[g]);
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
    if (rows[g] < 0) continue;
    row_of[g] = ring.data_ptr<int64_t>() + (slot * ring.size(1) + rows[g]) * ring.size(2);
    __atomic_fetch_add(row_of[g] + kCount, per_group, __ATOMIC_RELAXED);
    __atomic_fetch_add(row_of[g] + kCalls, 1, __ATOMIC_RELAXED);
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
