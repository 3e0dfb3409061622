// The CPU statistics loop for bfloat16 inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(c10::BFloat16);
HOOKCAP_PARTIAL(c10::BFloat16);
}  // namespace hookcap
