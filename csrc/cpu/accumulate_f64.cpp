// The CPU statistics loop for float64 inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(double);
HOOKCAP_PARTIAL(double);
}  // namespace hookcap
