// Host-side argument checks and launch descriptors, shared by the CPU, CUDA
// and Meta implementations so every backend rejects exactly the same input.
// Only metadata is inspected: no device memory is read (no sync). Sizes are
// read as SymInts so the same checks run on FakeTensors with dynamic shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "hookcap/state.h"
#include "hookcap/stats_math.h"
#include "hookcap/strided.h"
#include "hookcap/update_math.h"

namespace hookcap {

inline void check_ring_state(const at::Tensor& ring, const at::Tensor& state) {
  TORCH_CHECK(ring.scalar_type() == at::kLong && ring.dim() == 3 && ring.is_contiguous(),
              "hookcap: ring must be a contiguous int64 tensor [slots, rows, width], got ",
              ring.scalar_type(), " with shape ", ring.sym_sizes());
  TORCH_SYM_CHECK(ring.sym_size(0).sym_ge(1), "hookcap: ring needs >= 1 slot, got shape ",
                  ring.sym_sizes());
  TORCH_SYM_CHECK(ring.sym_size(2).sym_ge(static_cast<int64_t>(kHeader)),
                  "hookcap: ring width must be >= ", static_cast<int64_t>(kHeader), ", got shape ",
                  ring.sym_sizes());
  TORCH_CHECK(state.scalar_type() == at::kLong && state.dim() == 1 && state.is_contiguous(),
              "hookcap: state must be a contiguous int64 tensor of shape [3] "
              "(step, enabled, slot), got ", state.scalar_type(), " ", state.sym_sizes());
  TORCH_SYM_CHECK(state.sym_size(0).sym_eq(static_cast<int64_t>(kStateSize)),
                  "hookcap: state must be a contiguous int64 tensor of shape [3] "
                  "(step, enabled, slot), got shape ", state.sym_sizes());
  TORCH_CHECK(ring.device() == state.device(), "hookcap: ring is on ", ring.device(),
              " but state is on ", state.device());
}

// Row `row` lies in the ring ("hookcap.<op>: row ... out of range"). Concrete
// sizes (every call but a traced one's) compare as ints, without the
// symbolic compare's allocation: the hooks' hot path runs this check.
inline void check_row_in_rows(const char* op, int64_t row, int64_t rows) {
  TORCH_CHECK(rows > row, "hookcap.", op, ": row ", row, " out of range for a ring with ", rows, " rows");
}

inline void check_row_in_ring(const char* op, int64_t row, const at::Tensor& ring) {
  const c10::SymInt rows = ring.sym_size(1);
  if (const auto n = rows.maybe_as_int()) {
    check_row_in_rows(op, row, *n);
  } else {
    TORCH_SYM_CHECK(rows.sym_gt(row), "hookcap.", op, ": row ", row, " out of range for a ring with ", rows,
                    " rows");
  }
}

inline void check_reset_rows(const at::Tensor& ring, const at::Tensor& state, int64_t begin,
                             int64_t end) {
  check_ring_state(ring, state);
  TORCH_CHECK(begin >= 0 && begin <= end, "hookcap.reset_rows: need 0 <= begin <= end, got ",
              begin, ", ", end);
  TORCH_SYM_CHECK(ring.sym_size(1).sym_ge(end), "hookcap.reset_rows: end ", end,
                  " out of range for a ring with ", ring.sym_size(1), " rows");
}

inline void check_time_mark(const at::Tensor& ring, const at::Tensor& state, int64_t row,
                            int64_t phase) {
  check_ring_state(ring, state);
  TORCH_CHECK(phase == 0 || phase == 1,
              "hookcap.time_mark: phase must be 0 (forward) or 1 (backward), got ", phase);
  TORCH_CHECK(row >= 0, "hookcap.time_mark: row must be >= 0, got ", row);
  check_row_in_ring("time_mark", row, ring);
}

// At most this many bins of a log2 histogram between 2**lo and 2**hi, so
// that its counts (signed: about twice) fit any GPU's shared memory.
constexpr int64_t kMaxLog2Octaves = 2200;

// A log2 histogram's hist_bins argument: bins per octave (0 or 1: one; 2,
// 4, 8 or 16) plus 256 when the sign is kept (hookcap/histogram.py op_args).
struct Log2Layout {
  int64_t sub_shift;
  bool sign;
};

inline Log2Layout log2_layout(int64_t bins) {
  const int64_t sub = bins & 0xff;
  TORCH_CHECK(bins >= 0 && (bins >> 9) == 0 && (sub == 0 || sub == 1 || sub == 2 || sub == 4 || sub == 8 || sub == 16),
              "hookcap: a log2 histogram's hist_bins must be its bins per octave (1, 2, 4, 8 or 16), plus "
              "256 for signed bins, got ", bins);
  int64_t s = 0;
  while ((int64_t{1} << s) < sub) ++s;
  return {s, (bins & 0x100) != 0};
}

// Validates the histogram arguments against the ring width; returns the
// number of histogram bins they imply.
inline int64_t check_hist(int64_t kind_arg, double lo, double hi, int64_t bins,
                          const c10::SymInt& width) {
  TORCH_CHECK(kind_arg >= 0 && (kind_arg & ~(kHistKindMask | kMoments4Flag | kSideStreamFlag)) == 0,
              "hookcap: hist_kind must be 0 (none), 1 (log2) or 2 (linear), plus 16 for moments=4 and 32 "
              "for the side stream, got ", kind_arg);
  const int64_t kind = kind_arg & kHistKindMask;
  int64_t nbins = 0;
  if (kind == kHistNone) return nbins;
  TORCH_CHECK(kind == kHistLog2 || kind == kHistLinear,
              "hookcap: hist_kind must be 0 (none), 1 (log2) or 2 (linear), got ", kind);
  TORCH_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo < hi,
              "hookcap: histogram needs finite lo < hi, got lo=", lo, " hi=", hi);
  if (kind == kHistLog2) {
    TORCH_CHECK(lo == std::floor(lo) && hi == std::floor(hi) && lo >= -1100 && hi <= 1100,
                "hookcap: log2 histogram exponents must be integers in [-1100, 1100], got lo=",
                lo, " hi=", hi);
    const Log2Layout l = log2_layout(bins);
    TORCH_CHECK((hi - lo) * static_cast<double>(int64_t{1} << l.sub_shift) <= kMaxLog2Octaves,
                "hookcap: a log2 histogram may have at most ", kMaxLog2Octaves,
                " bins between 2**lo and 2**hi ((hi - lo) * sub), got lo=", lo, " hi=", hi, " sub=",
                int64_t{1} << l.sub_shift);
    nbins = log2_nbins(static_cast<int64_t>(lo), static_cast<int64_t>(hi), l.sub_shift, l.sign);
    TORCH_SYM_CHECK(width.sym_eq(kHeader + nbins), "hookcap: ring width ", width,
                    " does not fit a log2 histogram [", lo, ", ", hi, ") with hist_bins ", bins,
                    ": need ", kHeader + nbins);
  } else {
    TORCH_CHECK(bins >= 1, "hookcap: linear histogram needs bins >= 1, got ", bins);
    const double w = (hi - lo) / static_cast<double>(bins);
    TORCH_CHECK(w > 0 && std::isfinite(w),
                "hookcap: linear histogram bin width is not a positive finite number");
    TORCH_CHECK(w >= std::ldexp(std::max(std::abs(lo), std::abs(hi)), kLinearMinWidthExp),
                "hookcap: linear histogram bins of width ", w, " are narrower than 2^",
                kLinearMinWidthExp, " of max(|lo|, |hi|): not exactly placeable in double");
    nbins = bins + 2;
    TORCH_SYM_CHECK(width.sym_eq(kHeader + nbins), "hookcap: ring width ", width,
                    " does not fit a linear histogram of ", bins, " bins: need ",
                    kHeader + nbins);
  }
  return nbins;
}

// Launch form of the histogram arguments (concrete sizes only).
inline HistSpec make_hist_spec(int64_t kind, double lo, double hi, int64_t bins,
                               int64_t width) {
  HistSpec h{};
  check_hist(kind, lo, hi, bins, c10::SymInt(width));
  h.moments4 = (kind & kMoments4Flag) ? 1 : 0;
  kind &= kHistKindMask;
  h.kind = kind;
  h.nbins = width - kHeader;
  if (kind == kHistLog2) {
    h.lo_exp = static_cast<int64_t>(lo);
    h.hi_exp = static_cast<int64_t>(hi);
    const Log2Layout l = log2_layout(bins);
    h.sub_shift = l.sub_shift;
    h.sign = l.sign ? 1 : 0;
  } else if (kind == kHistLinear) {
    h.lo = lo;
    h.hi = hi;
    h.bins = bins;
    h.width = (hi - lo) / static_cast<double>(bins);
    h.inv_width = 1.0 / h.width;
  }
  return h;
}

// Whether hist_kind asks for hookcap's side stream (CUDA launches).
inline bool on_side_stream(int64_t hist_kind) { return (hist_kind & kSideStreamFlag) != 0; }

// The statistics op's checks of x and the row, for a ring and state
// check_ring_state passed.
// The types the kernels dispatch on, no other (float8 fnuz and e8m0 are floating types too).
inline void check_accumulate_dtype(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16 ||
                  t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2,
              "hookcap.accumulate: supported dtypes are float16, bfloat16, float32, float64, "
              "float8_e4m3fn and float8_e5m2, got ", t);
}

inline void check_accumulate_input(const at::Tensor& x, const at::Tensor& ring, int64_t row) {
  check_accumulate_dtype(x);
  TORCH_CHECK(x.layout() == at::kStrided,
              "hookcap.accumulate: only strided (dense-layout) tensors are supported, got ",
              x.layout());
  TORCH_CHECK(x.device() == ring.device(), "hookcap.accumulate: x is on ", x.device(),
              " but the ring is on ", ring.device());
  TORCH_CHECK(row >= 0, "hookcap.accumulate: row must be >= 0, got ", row);
  check_row_in_ring("accumulate", row, ring);
}

inline void check_accumulate(const at::Tensor& x, const at::Tensor& ring,
                             const at::Tensor& state, int64_t row) {
  check_ring_state(ring, state);
  check_accumulate_input(x, ring, row);
}

// One entry of an op's list of rows: a row of the ring, or -1 (not recorded).
inline void check_row_or_skip(const char* op, int64_t r, const at::Tensor& ring) {
  TORCH_CHECK(r >= -1, "hookcap.", op, ": a row must be >= 0 or -1, got ", r);
  check_row_in_ring(op, r, ring);
}

// accumulate_many: xs[i] into rows[i] (-1: not recorded, not checked);
// every tensor is checked before any is written.
inline void check_many(at::TensorList xs, const at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows) {
  check_ring_state(ring, state);
  TORCH_CHECK(rows.size() == xs.size(), "hookcap.accumulate_many: ", xs.size(), " tensors but ", rows.size(),
              " rows");
  for (size_t i = 0; i < xs.size(); ++i) {
    check_row_or_skip("accumulate_many", rows[i], ring);
    if (rows[i] >= 0) check_accumulate_input(xs[i], ring, rows[i]);
  }
}

// accumulate_groups: x split along `dim` into groups of `size` slices, one
// row per group (`rows`, -1: not recorded).
inline void check_groups(const at::Tensor& x, const at::Tensor& ring, const at::Tensor& state,
                         c10::IntArrayRef rows, int64_t dim, int64_t size) {
  check_accumulate(x, ring, state, 0);
  TORCH_CHECK(x.dim() >= 1, "hookcap.accumulate_groups: x must have at least one dimension");
  TORCH_CHECK(dim >= -x.dim() && dim < x.dim(), "hookcap.accumulate_groups: dim ", dim,
              " out of range for a tensor of ", x.dim(), " dimensions");
  const int64_t extent = x.size(dim < 0 ? dim + x.dim() : dim);
  TORCH_CHECK(size >= 1 && extent % size == 0, "hookcap.accumulate_groups: size ", size,
              " must divide dimension ", dim, " (", extent, ")");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == extent / size, "hookcap.accumulate_groups: ",
              extent / size, " groups but ", rows.size(), " rows");
  for (const int64_t r : rows) check_row_or_skip("accumulate_groups", r, ring);
}

// Whether accumulate_groups' groups can share one launch of the statistics
// kernel (grid rows): every group recorded, their rows evenly spaced, at
// most 65,535 of them, and each group's first element 16 bytes apart from
// the previous one's times a whole number, so that every group's view reads
// as group 0's does (the same vector plan).
struct GroupLaunch {
  bool ok;
  int64_t groups, row_step, x_step;
};
inline GroupLaunch group_launch(const at::Tensor& x, c10::IntArrayRef rows, int64_t dim, int64_t size) {
  const int64_t groups = static_cast<int64_t>(rows.size());
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  const int64_t x_step = size * x.stride(d);
  const int64_t row_step = groups > 1 ? rows[1] - rows[0] : 0;
  bool ok = groups >= 1 && groups <= 65535 && (x_step * static_cast<int64_t>(x.element_size())) % 16 == 0;
  for (int64_t g = 0; ok && g < groups; ++g) ok = rows[g] >= 0 && rows[g] == rows[0] + g * row_step;
  return {ok, groups, row_step, x_step};
}

// accumulate_bins: integer indices (any shape, strided or not: the kernels
// read them through contiguous() only when dense) and optional weights of the
// same shape, one row per bin (`rows`, -1: not recorded).
inline void check_bins(const at::Tensor& index, const c10::optional<at::Tensor>& weight, const at::Tensor& ring,
                       const at::Tensor& state, c10::IntArrayRef rows) {
  check_ring_state(ring, state);
  const at::ScalarType t = index.scalar_type();
  TORCH_CHECK(t == at::kLong || t == at::kInt || t == at::kShort || t == at::kChar || t == at::kByte,
              "hookcap.accumulate_bins: index must be an integer tensor (int64, int32, int16, int8 or uint8), got ",
              t);
  TORCH_CHECK(index.layout() == at::kStrided && index.is_contiguous(),
              "hookcap.accumulate_bins: index must be a contiguous strided tensor");
  TORCH_CHECK(index.device() == ring.device(), "hookcap.accumulate_bins: index is on ", index.device(),
              " but the ring is on ", ring.device());
  if (weight.has_value() && weight->defined()) {
    const at::ScalarType w = weight->scalar_type();
    TORCH_CHECK(w == at::kFloat || w == at::kDouble || w == at::kHalf || w == at::kBFloat16,
                "hookcap.accumulate_bins: weight must be float16, bfloat16, float32 or float64, got ", w);
    TORCH_CHECK(weight->layout() == at::kStrided && weight->is_contiguous(),
                "hookcap.accumulate_bins: weight must be a contiguous strided tensor");
    TORCH_CHECK(weight->device() == ring.device(), "hookcap.accumulate_bins: weight is on ", weight->device(),
                " but the ring is on ", ring.device());
    TORCH_SYM_CHECK(weight->sym_numel().sym_eq(index.sym_numel()),
                    "hookcap.accumulate_bins: weight must have index's number of elements");
  }
  TORCH_CHECK(!rows.empty(), "hookcap.accumulate_bins: rows needs one row per bin, got none");
  for (const int64_t r : rows) check_row_or_skip("accumulate_bins", r, ring);
}

// attention_rows: a contiguous float32 tile of logits [..., rows, keys]
// (masked in place from its first causal query `causal_row0`; -1: none).
inline void check_attention_rows(const at::Tensor& logits, int64_t causal_row0) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() >= 2 && logits.is_contiguous(),
              "hookcap: attention_rows needs a contiguous float32 tensor [..., rows, keys], got ",
              logits.scalar_type(), " with shape ", logits.sym_sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(causal_row0 >= -1, "hookcap: attention_rows: causal_row0 must be >= 0 (the tile's first query) "
              "or -1 (no causal mask), got ", causal_row0);
}

// accumulate_attention: a tile [B, H, rows, keys] (attention_rows' input)
// and per head h the rows of its logits, its rows' logsumexp and entropy
// (-1: not recorded).
inline void check_attention_record(const at::Tensor& logits, int64_t causal_row0, const at::Tensor& ring,
                                   const at::Tensor& state, c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows,
                                   c10::IntArrayRef entropy_rows) {
  check_attention_rows(logits, causal_row0);
  check_accumulate(logits, ring, state, 0);
  TORCH_CHECK(logits.dim() == 4, "hookcap.accumulate_attention: logits must be [batch, heads, rows, keys], got ",
              logits.dim(), " dimensions");
  for (const c10::IntArrayRef rows : {logit_rows, lse_rows, entropy_rows}) {
    TORCH_CHECK(static_cast<int64_t>(rows.size()) == logits.size(1), "hookcap.accumulate_attention: ",
                logits.size(1), " heads but ", rows.size(), " rows");
    for (const int64_t r : rows) check_row_or_skip("accumulate_attention", r, ring);
  }
}

// attention_qk: q [B, H, Tq, D] and k [B, Hk, Tk, D] on the ring's device,
// and per head h the rows of its logits, its rows' logsumexp and entropy
// (-1: not recorded). What its kernel takes beyond that:
// cuda/attention_qk_plan.h attention_qk_unsupported.
inline void check_attention_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& ring,
                               const at::Tensor& state, c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows,
                               c10::IntArrayRef entropy_rows) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "hookcap.attention_qk: q and k must be [batch, heads, tokens, "
              "head_dim], got shapes ", q.sym_sizes(), " and ", k.sym_sizes());
  check_ring_state(ring, state);
  TORCH_CHECK(q.device() == ring.device() && k.device() == ring.device(), "hookcap.attention_qk: q and k are on ",
              q.device(), " and ", k.device(), " but the ring is on ", ring.device());
  for (const c10::IntArrayRef rows : {logit_rows, lse_rows, entropy_rows}) {
    TORCH_CHECK(q.sym_size(1) == static_cast<int64_t>(rows.size()), "hookcap.attention_qk: ", q.sym_size(1),
                " heads but ", rows.size(), " rows");
    for (const int64_t r : rows) check_row_or_skip("attention_qk", r, ring);
  }
}

// attention_rows' checked input's geometry and its outputs (float32
// [..., rows], uninitialised), as every backend makes them.
struct AttentionRows {
  at::Tensor lse, entropy;
  int64_t rows;       // of the whole tensor
  int64_t tile_rows;  // logits.size(-2)
  int64_t keys;       // logits.size(-1)
};

inline AttentionRows attention_rows_outputs(const at::Tensor& logits, int64_t causal_row0) {
  check_attention_rows(logits, causal_row0);
  auto sizes = logits.sizes().vec();
  const int64_t keys = sizes.back();
  sizes.pop_back();
  AttentionRows a{at::empty(sizes, logits.options()), at::empty(sizes, logits.options()), 0, sizes.back(), keys};
  a.rows = a.lse.numel();
  return a;
}

// How a kernel reads x (strided.h): dense inputs (contiguous in some
// dimension order, no overlap) are a flat run of numel elements starting at
// data_ptr (torch strides are never negative, so the lowest address); other
// views get a plan, without copying (`max_walk`: see plan_dims).
inline DimPlan plan_read(const at::Tensor& x, int64_t max_walk = kMaxDims) {
  if (x.is_non_overlapping_and_dense()) {
    DimPlan p{};
    p.flat = true;
    p.visit = x.numel();
    p.mult = 1;
    return p;
  }
  TORCH_CHECK(x.dim() <= kMaxTensorDims, "hookcap.accumulate: views with more than ",
              kMaxTensorDims, " dimensions are not supported, got ", x.dim());
  return plan_dims(x.dim(), x.sizes().data(), x.strides().data(), max_walk);
}

// accumulate_update: the parameter and every state tensor the rule reads are
// dense with the parameter's sizes and strides (element i of each is at
// offset i from its data pointer), of the parameter's dtype and device.
// `rows`: kOutputs rows (update_math.h kOut*), -1 where not recorded, at
// least one recorded.
inline void check_update(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                         const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                         const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper,
                         int64_t rule, const at::Tensor& ring, const at::Tensor& state,
                         c10::IntArrayRef rows) {
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == kOutputs, "hookcap.accumulate_update: rows needs ",
              static_cast<int64_t>(kOutputs), " entries (update, base, ratio, a, b; -1: not recorded), got ",
              static_cast<int64_t>(rows.size()));
  int64_t first = -1;
  for (const int64_t r : rows) {
    check_row_or_skip("accumulate_update", r, ring);
    if (first < 0) first = r;
  }
  TORCH_CHECK(first >= 0, "hookcap.accumulate_update: rows records nothing (every entry is -1)");
  check_accumulate(param, ring, state, first);
  const at::ScalarType t = param.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16,
              "hookcap.accumulate_update: parameters of float32, float64, float16 or bfloat16, got ", t);
  TORCH_CHECK(rule >= 0 && rule < kRules, "hookcap.accumulate_update: rule must be 0 (SGD), 1 (Adam) "
              "or 2 (difference), got ", rule);
  TORCH_CHECK(static_cast<int64_t>(hyper.size()) == kHypCount, "hookcap.accumulate_update: hyper needs ",
              static_cast<int64_t>(kHypCount), " values, got ", static_cast<int64_t>(hyper.size()));
  TORCH_CHECK(param.is_non_overlapping_and_dense(),
              "hookcap.accumulate_update: the parameter must be dense (no gaps or overlaps)");
  auto same = [&](const c10::optional<at::Tensor>& x, const char* what, bool needed) {
    if (!x.has_value() || !x->defined()) {
      TORCH_CHECK(!needed, "hookcap.accumulate_update: rule ", rule, " with these rows needs ", what);
      return;
    }
    TORCH_CHECK(x->scalar_type() == t && x->device() == param.device() &&
                    x->sym_sizes() == param.sym_sizes() && x->sym_strides() == param.sym_strides(),
                "hookcap.accumulate_update: ", what, " must have the parameter's dtype, device, sizes "
                "and strides (", t, " ", param.device(), " ", param.sym_sizes(), " ", param.sym_strides(),
                "), got ", x->scalar_type(), " ", x->device(), " ", x->sym_sizes(), " ", x->sym_strides());
  };
  const bool has_buf = static_cast<int64_t>(hyper[kHypFlags]) & kFlagHasBuf;
  const bool adam = rule == kRuleAdam;
  const bool ratio = rows[kOutRatio] >= 0;
  TORCH_CHECK(!ratio || adam, "hookcap.accumulate_update: the ratio row needs rule 1 (Adam)");
  same(grad, "the gradient", ratio || (rule == kRuleSgd && !(has_buf && !(
      static_cast<int64_t>(hyper[kHypFlags]) & kFlagNesterov))));
  same(a, rule == kRuleSgd ? "the momentum buffer" : rule == kRuleDiff ? "the copy" : "exp_avg",
       adam || rule == kRuleDiff || (rule == kRuleSgd && has_buf) || rows[kOutA] >= 0);
  same(b, "exp_avg_sq", adam || rows[kOutB] >= 0);
  if (step.has_value() && step->defined()) {
    TORCH_CHECK(step->numel() == 1 && (step->scalar_type() == at::kFloat || step->scalar_type() == at::kDouble),
                "hookcap.accumulate_update: step must be one float32 or float64 value, got ",
                step->scalar_type(), " ", step->sym_sizes());
    TORCH_CHECK(step->is_cpu() || step->device() == param.device(),
                "hookcap.accumulate_update: step must be on the CPU or the parameter's device, got ",
                step->device());
  }
}

// The rule's constants; Adam's bias corrections from `step` where the host
// can read it (a CPU tensor, or hyper[kHypStep] without one).
inline UpdateRule make_update_rule(int64_t rule, c10::ArrayRef<double> hyper, double step) {
  UpdateRule r{};
  r.rule = static_cast<int>(rule);
  r.lr = hyper[kHypLr];
  r.wd = hyper[kHypWeightDecay];
  r.momentum = hyper[kHypMomentum];
  r.beta1 = hyper[kHypBeta1];
  r.beta2 = hyper[kHypBeta2];
  r.eps = hyper[kHypEps];
  r.flags = static_cast<int>(hyper[kHypFlags]);
  update_set_keep(r);
  update_set_step(r, step);
  return r;
}

// A CPU step tensor's value (else hyper's).
inline double host_step(const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper) {
  if (!step.has_value() || !step->defined() || !step->is_cpu()) return hyper[kHypStep];
  return step->scalar_type() == at::kDouble ? *step->const_data_ptr<double>()
                                            : static_cast<double>(*step->const_data_ptr<float>());
}

// A tensor's data, or null for an absent optional tensor.
template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<T>() : nullptr;
}

// What a kernel launch of accumulate_update needs of the step count: the
// rule, with the bias corrections of a step the host can read, and the
// pointer of a step count the kernel reads instead (`on_device`: capturable
// or fused Adam's, on the GPU; then the host never reads it).
struct UpdateLaunch {
  UpdateRule rule;
  const float* step_f;
  const double* step_d;
};
inline UpdateLaunch update_launch(int64_t rule, c10::ArrayRef<double> hyper,
                                  const c10::optional<at::Tensor>& step, bool on_device) {
  const bool dev = on_device && step.has_value() && step->defined();
  return {make_update_rule(rule, hyper, dev ? 1.0 : host_step(step, hyper)),
          dev && step->scalar_type() == at::kFloat ? step->const_data_ptr<float>() : nullptr,
          dev && step->scalar_type() == at::kDouble ? step->const_data_ptr<double>() : nullptr};
}

// One parameter of an accumulate_updates call.
struct UpdateArgs {
  const at::Tensor& param;
  c10::optional<at::Tensor> grad, a, b, step;
  c10::IntArrayRef rows;  // kOutputs
};

// Calls fn(UpdateArgs) for each parameter of an accumulate_updates call,
// after checking that every list has one entry per parameter (rows: kOutputs).
template <typename Fn>
void for_each_update(at::TensorList params, const c10::List<c10::optional<at::Tensor>>& grads,
                     const c10::List<c10::optional<at::Tensor>>& a,
                     const c10::List<c10::optional<at::Tensor>>& b,
                     const c10::List<c10::optional<at::Tensor>>& steps, c10::IntArrayRef rows, Fn&& fn) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && a.size() == n && b.size() == n && steps.size() == n &&
                  rows.size() == n * kOutputs,
              "hookcap.accumulate_updates: grads, a, b and steps need one entry per parameter (", n,
              ") and rows ", static_cast<int64_t>(kOutputs), " per parameter");
  for (size_t i = 0; i < n; ++i) {
    fn(UpdateArgs{params[i], grads.get(i), a.get(i), b.get(i), steps.get(i), rows.slice(i * kOutputs, kOutputs)});
  }
}

// Every parameter of an accumulate_updates call checked: each backend calls
// this before it writes any, so a call fails whole or not at all.
inline void check_updates(at::TensorList params, const c10::List<c10::optional<at::Tensor>>& grads,
                          const c10::List<c10::optional<at::Tensor>>& a,
                          const c10::List<c10::optional<at::Tensor>>& b,
                          const c10::List<c10::optional<at::Tensor>>& steps, c10::ArrayRef<double> hyper,
                          int64_t rule, const at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows) {
  for_each_update(params, grads, a, b, steps, rows, [&](const UpdateArgs& u) {
    check_update(u.param, u.grad, u.a, u.b, u.step, hyper, rule, ring, state, u.rows);
  });
}

// accumulate_updates for a backend whose accumulate_update is kOne:
// check_updates, then kOne on each parameter.
template <auto kOne>
void accumulate_updates_each(at::TensorList params, const c10::List<c10::optional<at::Tensor>>& grads,
                             const c10::List<c10::optional<at::Tensor>>& a,
                             const c10::List<c10::optional<at::Tensor>>& b,
                             const c10::List<c10::optional<at::Tensor>>& steps, c10::ArrayRef<double> hyper,
                             int64_t rule, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                             int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_updates(params, grads, a, b, steps, hyper, rule, ring, state, rows);
  for_each_update(params, grads, a, b, steps, rows, [&](const UpdateArgs& u) {
    kOne(u.param, u.grad, u.a, u.b, u.step, hyper, rule, ring, state, u.rows, hist_kind, hist_lo, hist_hi,
         hist_bins);
  });
}

}  // namespace hookcap
