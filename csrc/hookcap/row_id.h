#pragma once
// A ring row's one identity, in C++ and Python alike: the ring's index in its
// Monitor's ring list, shifted by kRowBits, or'ed with the row within that
// ring. Python reads kRowBits as hookcap._C.ROW_BITS (hookcap/_fastpath.py).
#include <cstdint>

namespace hookcap {
constexpr int kRowBits = 32;
}  // namespace hookcap
