// The CPU statistics loop for float8_e4m3fn inputs (a file per dtype: the build
// compiles them in parallel).
#include "cpu/stats_loop.h"

namespace hookcap {
template HOOKCAP_ACCUMULATE_READ(c10::Float8_e4m3fn);
HOOKCAP_PARTIAL(c10::Float8_e4m3fn);
}  // namespace hookcap
