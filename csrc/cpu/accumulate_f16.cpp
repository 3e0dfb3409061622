// The CPU statistics loop for float16 inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(c10::Half);
HOOKCAP_PARTIAL(c10::Half);
}  // namespace hookcap
