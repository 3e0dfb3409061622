// The CPU statistics loop, for other CPU kernels that produce values
// rather than read a tensor (accumulate_update).
#pragma once

#include <cstdint>

#include "hookcap/stats_math.h"

namespace hookcap {

// Merges n doubles at x into `row` (count and calls excepted: the caller
// counts its elements and its call), fixing the row's shift if unset.
void accumulate_doubles_cpu(const double* x, int64_t n, int64_t* row, const HistSpec& h);

}  // namespace hookcap
