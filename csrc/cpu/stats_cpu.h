// What the CPU statistics kernels share with other CPU kernels
// (accumulate_update): the slot a state names, and the statistics loop for
// values produced rather than read from a tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "hookcap/stats_math.h"

namespace hookcap {

// The slot named by a CPU state, checked against the ring's slot count.
int64_t state_slot(const at::Tensor& ring, const int64_t* st);
int64_t state_slot(int64_t slots, const int64_t* st);

// Row `row` of slot `slot` of a CPU ring, its count raised by `n` and its
// calls by one: a call's bookkeeping, made before its values are merged.
inline int64_t* counted_row(at::Tensor& ring, int64_t slot, int64_t row, int64_t n) {
  int64_t* r = ring.data_ptr<int64_t>() + (slot * ring.size(1) + row) * ring.size(2);
  __atomic_fetch_add(r + kCount, n, __ATOMIC_RELAXED);
  __atomic_fetch_add(r + kCalls, 1, __ATOMIC_RELAXED);
  return r;
}

// Merges tensor x (any layout the statistics op reads) into `row`, count
// and calls excepted, with the statistics op's own loop.
void accumulate_tensor_cpu(const at::Tensor& x, int64_t* row, const HistSpec& h);

// The statistics op's CPU kernel after its checks (check_accumulate), with
// the histogram arguments in launch form: for callers that checked the ring
// and state once and the input each call (grad_hooks.cpp's fast paths).
void accumulate_row_cpu(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, int64_t row_index,
                        const HistSpec& h);

// A checked CPU ring and state, their pointers and shape read once (a ring
// never changes shape: growth makes a new one).
struct CpuRing {
  int64_t* data = nullptr;
  const int64_t* state = nullptr;
  int64_t slots = 0, rows = 0, width = 0;
};
CpuRing cpu_ring(at::Tensor& ring, const at::Tensor& state);

// accumulate_row_cpu into a CpuRing: x's dtype and the row checked by the caller.
void accumulate_row_cpu(const at::Tensor& x, const CpuRing& r, int64_t row_index, const HistSpec& h);

// Whether this CPU runs the AVX2+FMA+F16C builds of the loops.
bool cpu_avx2();

// One thread's statistics, for one row, of values pushed piece by piece:
// values another kernel produces block by block (accumulate_update), or a
// group's slices of a tensor (accumulate_groups). Merged into the row once by
// partial_flush (count and calls excepted: the caller counts its elements and
// its call), with the statistics op's own loop for T (float sums per block,
// the exponent and key histogram paths). The row's shift is fixed by the
// first push of any writer (first writer wins, as everywhere). T is each
// dtype the statistics op reads (instantiated in accumulate_<dtype>.cpp).
constexpr int64_t kPartialLocalWords = 4 * 2101;  // the local histogram's counters (stats_loop.h)
struct Partial {
  Acc acc;
  WideAcc wide;
  int64_t* row;
  const HistSpec* h;
  uint32_t* local;  // kPartialLocalWords counters, or null: bins count straight into the row
  int kind;         // the loop variant (stats_loop.h's with_loop_kind)
  int copies;       // local copies of the histogram, each `cs` entries
  int64_t cs;
  int64_t pending;  // values counted in `local` since its last flush
  int64_t zeros;    // zeros among them
  double shift;
  double center;    // where the next push's sums start (the last block's next_center)
  bool started;
};
template <typename T>
void partial_begin(Partial& p, int64_t* row, const HistSpec& h, uint32_t* local);
// n contiguous values.
template <typename T>
void partial_push(Partial& p, const T* x, int64_t n);
// `rows` runs of `run` contiguous values (rows_run_ok),
// the runs `step` elements apart; each value read prefetches the one `ahead`
// elements after it (0: none), e.g. the same place in the caller's next piece;
// or, where `seq` is given, as many bytes from `seq` on, in address order,
// into L2 (and the runs a few rows ahead into L1).
template <typename T>
void partial_push_rows(Partial& p, const T* x, int64_t rows, int64_t step, int64_t run, int64_t ahead,
                       const void* seq = nullptr);
void partial_flush(Partial& p);  // its loop kind says all: one for every T

// Whether runs of `run` contiguous values can be read in place as rows
// (partial_push_rows; the statistics op's strided reads too): a multiple of
// 16 values (each half of the loop's 32-value vector iteration lies in one
// row), at most one block.
constexpr int64_t kRowsMaxRun = 2048;
inline bool rows_run_ok(int64_t run) { return run >= 16 && run <= kRowsMaxRun && run % 16 == 0; }

// The row's shift: `cand` if this writer is the first, else the one fixed.
double row_shift(int64_t* row, double cand);

}  // namespace hookcap
