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

// Merges tensor x (any layout the statistics op reads) into `row`, count
// and calls excepted, with the statistics op's own loop.
void accumulate_tensor_cpu(const at::Tensor& x, int64_t* row, const HistSpec& h);

// Whether this CPU runs the AVX2+FMA+F16C builds of the loops.
bool cpu_avx2();

// One thread's statistics of doubles a kernel produces block by block
// (accumulate_update) for one row: pushed block by block, merged into the
// row once by doubles_flush (count and calls excepted: the caller counts its
// elements and its call). The row's shift is fixed by the first push of any
// writer (first writer wins, as everywhere).
constexpr int64_t kDoublesLocalWords = 4 * 2101;  // the local histogram's counters (stats_cpu.cpp)
struct DoublesPartial {
  Acc acc;
  WideAcc wide;
  int64_t* row;
  const HistSpec* h;
  uint32_t* local;  // kDoublesLocalWords counters, or null: bins count straight into the row
  double shift;
  bool started;
};
void doubles_begin(DoublesPartial& p, int64_t* row, const HistSpec& h, uint32_t* local);
void doubles_push(DoublesPartial& p, const double* x, int64_t n);
void doubles_flush(DoublesPartial& p);

// The same for floats, with the float32 statistics op's loop (float sums
// per block, the exponent and key histogram paths): accumulate_f32.cpp.
struct FloatsPartial {
  Acc acc;
  WideAcc wide;
  int64_t* row;
  const HistSpec* h;
  uint32_t* local;  // kDoublesLocalWords counters, or null: bins count straight into the row
  int kind;         // the loop variant (stats_loop.h's with_loop_kind)
  int copies;       // local copies of the histogram, each `cs` entries
  int64_t cs;
  int64_t pending;  // values counted in `local` since its last flush
  int64_t zeros;    // zeros among them
  double shift;
  bool started;
};
void floats_begin(FloatsPartial& p, int64_t* row, const HistSpec& h, uint32_t* local);
void floats_push(FloatsPartial& p, const float* x, int64_t n);
void floats_flush(FloatsPartial& p);

// The row's shift: `cand` if this writer is the first, else the one fixed.
double row_shift(int64_t* row, double cand);

}  // namespace hookcap
