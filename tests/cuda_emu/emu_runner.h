// The real CUDA kernels (csrc/cuda/stats_kernel.cuh) compiled as host code on
// top of cuda_emu.h, with thin launch wrappers. Shared by the Python harness
// (emu_ops.cpp) and the standalone TSan / fault-injection driver
// (emu_selftest.cpp). No torch here: the driver must not need libtorch.
#pragma once

#include <cmath>
#include <vector>

#include "cuda_emu.h"
// The kernels, unchanged: what CI runs is what nvcc builds.
#include "cuda/attention_kernel.cuh"
#include "cuda/attention_qk_kernel.cuh"
#include "cuda/bins_kernel.cuh"
#include "cuda/stats_kernel.cuh"
#include "cuda/update_kernel.cuh"

namespace hookcap_emu {

using hookcap::HistSpec;
using hookcap::StridedDesc;
using hookcap::kernels::RowTarget;

// The shared-memory budget of an H100 (sm_90), the launcher's there.
constexpr int64_t kH100SmemBudget = hookcap::kernels::smem_budget(233472, 1024, 232448);

// As the launcher: the plan's dynamic shared memory.
template <typename T>
void accumulate(const T* x, int64_t n, hookcap::ReadKind read, const StridedDesc& d, const RowTarget& tgt,
                const HistSpec& h, dim3 grid, dim3 block, int64_t smem_budget = kH100SmemBudget) {
  hookcap::kernels::dispatch_accumulate<T>(
      read, h, smem_budget, [&](auto kernel, const hookcap::kernels::HistPlan& plan) {
        emu::launch(kernel, grid, block, static_cast<size_t>(plan.smem), x, n, d, tgt, h, plan.lin,
                    hookcap::kernels::ManyArg<false>{});
      });
}

// A many-tensor launch (accumulate_many): grid rows = the table's tensors.
template <typename T>
void accumulate_many(const hookcap::kernels::ManyTable& table, int64_t tensors, const RowTarget& tgt,
                     const HistSpec& h, int64_t grid, dim3 block, int64_t smem_budget = kH100SmemBudget) {
  hookcap::kernels::dispatch_accumulate<T, true>(
      hookcap::kReadFlat, h, smem_budget, [&](auto kernel, const hookcap::kernels::HistPlan& plan) {
        emu::launch(kernel, dim3(static_cast<unsigned>(grid), static_cast<unsigned>(tensors)), block,
                    static_cast<size_t>(plan.smem), static_cast<const T*>(nullptr), int64_t{0}, StridedDesc{},
                    tgt, h, plan.lin, hookcap::kernels::ManyArg<true>{table});
      });
}

// reset_slot launches reset_rows_kernel over every row, as the launcher does.
inline void reset_rows(int64_t* ring, const int64_t* state, int64_t slots, int64_t rows,
                       int64_t width, int64_t begin, int64_t end, dim3 grid, dim3 block) {
  emu::launch(hookcap::kernels::reset_rows_kernel, grid, block, 0, ring, state, slots, rows,
              width, begin, end);
}

inline void reset_slot(int64_t* ring, const int64_t* state, int64_t slots, int64_t rows,
                       int64_t width, dim3 grid, dim3 block) {
  reset_rows(ring, state, slots, rows, width, 0, rows, grid, block);
}

// As the launcher: the reset of the next slot on any grid, then the state
// moved by one thread (the next launch on the same stream).
inline void advance(int64_t* ring, int64_t* state, int64_t slots, int64_t rows, int64_t width,
                    int64_t every, dim3 grid, dim3 block) {
  emu::launch(hookcap::kernels::advance_reset_kernel, grid, block, 0, ring,
              static_cast<const int64_t*>(state), slots, rows, width, every);
  emu::launch(hookcap::kernels::advance_state_kernel, dim3(1), dim3(1), 0, state, slots, every);
}

}  // namespace hookcap_emu
