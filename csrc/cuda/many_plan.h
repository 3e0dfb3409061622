// The launches of accumulate_many, shared by the CUDA launcher
// (stats_launch.cu) and the CPU emulation harness. Tensors a many-tensor
// launch reads (contiguous, element-aligned, float16/bfloat16/float32/
// float64) go kernels::kManyTensors to a launch, batched by dtype and by the
// grid each would get alone (a power-of-two bucket of its blocks, so a
// launch's grid is within 2x of each of its tensors'); every other tensor
// launches alone. The batches being filled live on the stack.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "cuda/stats_kernel.cuh"

namespace hookcap {

struct ManyBatch {
  int key = -1;  // dtype * 64 + bucket; -1: free
  at::ScalarType dtype = at::kFloat;
  int tensors = 0;
  int64_t blocks = 1;  // the grid's x: the most any of its tensors would get alone
  kernels::ManyTable table;
};

// Blocks of a launch of its own for n elements: `per_block` elements each, 1 .. most.
inline int64_t blocks_for_elements(int64_t n, int64_t per_block, int64_t most) {
  return std::max<int64_t>(1, std::min((n + per_block - 1) / per_block, most));
}

// A many-tensor launch's RowTarget: its rows, counts and calls come from the
// table (one call per tensor), so only the ring, state and geometry matter.
inline kernels::RowTarget many_target(at::Tensor& ring, const at::Tensor& state) {
  return kernels::RowTarget{ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), 0, ring.size(1), ring.size(2),
                            ring.size(0), 0, 1, 1, nullptr, 0, 0};
}

inline bool many_reads(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  return (t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16) && x.is_contiguous() &&
         reinterpret_cast<uintptr_t>(x.const_data_ptr()) % x.element_size() == 0;
}

// single(i): xs[i] in a launch of its own; launch(batch): one many-tensor
// launch. rows[i] < 0: not recorded.
template <typename Single, typename Launch>
void plan_many(at::TensorList xs, c10::IntArrayRef rows, int64_t per_block, int64_t most, Single&& single,
               Launch&& launch) {
  constexpr int kOpen = 6;
  ManyBatch open[kOpen];
  auto flush = [&](ManyBatch& b) {
    if (b.tensors > 0) launch(static_cast<const ManyBatch&>(b));
    b = ManyBatch{};
  };
  for (size_t i = 0; i < xs.size(); ++i) {
    if (rows[i] < 0) continue;
    const at::Tensor& x = xs[i];
    if (!many_reads(x)) {
      single(i);
      continue;
    }
    const int64_t blocks = blocks_for_elements(x.numel(), per_block, most);
    int bucket = 0;
    while ((int64_t{1} << bucket) < blocks) ++bucket;
    const int key = static_cast<int>(x.scalar_type()) * 64 + bucket;
    ManyBatch* b = nullptr;
    for (ManyBatch& o : open) {
      if (o.key == key) b = &o;
    }
    if (b == nullptr) {  // a free batch, else the fullest launches now
      ManyBatch* fullest = &open[0];
      for (ManyBatch& o : open) {
        if (o.key < 0 && b == nullptr) b = &o;
        if (o.tensors > fullest->tensors) fullest = &o;
      }
      if (b == nullptr) {
        flush(*fullest);
        b = fullest;
      }
      b->key = key;
      b->dtype = x.scalar_type();
    }
    b->table.x[b->tensors] = x.const_data_ptr();
    b->table.n[b->tensors] = x.numel();
    b->table.row[b->tensors] = rows[i];
    b->blocks = std::max(b->blocks, blocks);
    if (++b->tensors == kernels::kManyTensors) flush(*b);
  }
  for (ManyBatch& b : open) flush(b);
}

}  // namespace hookcap
