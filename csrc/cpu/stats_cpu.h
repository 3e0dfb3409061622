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

// Merges n doubles at x into `row` (count and calls excepted: the caller
// counts its elements and its call), fixing the row's shift if unset.
void accumulate_doubles_cpu(const double* x, int64_t n, int64_t* row, const HistSpec& h);

}  // namespace hookcap
