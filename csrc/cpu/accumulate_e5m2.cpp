// The CPU statistics loop for float8_e5m2 inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(c10::Float8_e5m2);
HOOKCAP_PARTIAL(c10::Float8_e5m2);
}  // namespace hookcap
