// Device-resident step state: int64[3] = (step, enabled, slot). Kernels read
// the slot and the enabled flag from it, so neither is ever baked into a
// launch (CUDA-graph replay and torch.compile see one graph for all steps).
#pragma once

#include <c10/macros/Macros.h>
#include <cstdint>

namespace hookcap {

enum StateIdx : int64_t { kStateStep = 0, kStateEnabled = 1, kStateSlot = 2, kStateSize = 3 };

struct StepState {
  int64_t step, enabled, slot;
};

// Close the current step and open the next: the step counter always
// advances; only every `every`-th step is recorded, and each recorded step
// takes the next ring slot.
C10_HOST_DEVICE C10_ALWAYS_INLINE StepState next_state(const int64_t* s, int64_t every,
                                            int64_t slots) {
  StepState n;
  n.step = s[kStateStep] + 1;
  n.enabled = (n.step % every) == 0 ? 1 : 0;
  n.slot = n.enabled ? (s[kStateSlot] + 1) % slots : s[kStateSlot];
  return n;
}

}  // namespace hookcap
