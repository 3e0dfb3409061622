// The CPU statistics loop for float32 inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(float);
HOOKCAP_PARTIAL(float);
}  // namespace hookcap
