// Standalone driver of the CUDA emulation (no libtorch, so it can run under
// ThreadSanitizer): the real kernels on generated data with NaN/Inf/subnormals/
// -0, misaligned and strided inputs, merges, slot reset and advance, checked
// against a plain sequential reference written here. tests/test_cuda_emu.py
// builds it with -fsanitize=thread and in fault-injection variants.
// Exit: 0 all checks pass, 1 a result mismatch, 3 a kernel fault (TSan uses
// its own exit code).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "emu_runner.h"

namespace {

using namespace hookcap;

int g_failures = 0;

#define CHECK(cond, ...)                                         \
  do {                                                           \
    if (!(cond)) {                                               \
      ++g_failures;                                              \
      std::printf("MISMATCH %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                  \
      std::printf("\n");                                         \
    }                                                            \
  } while (0)

uint64_t g_rng = 0x9e3779b97f4a7c15ull;
uint64_t next_u64() {  // splitmix64
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Values of every class; `max_exp` and `sub` keep them inside T's range.
template <typename T>
std::vector<T> make_data(size_t n, int max_exp, double sub) {
  std::vector<T> v(n);
  for (auto& e : v) {
    const uint64_t r = next_u64();
    double d;
    switch (r % 16) {
      case 0: d = NAN; break;
      case 1: d = INFINITY; break;
      case 2: d = -INFINITY; break;
      case 3: d = 0.0; break;
      case 4: d = -0.0; break;
      case 5: d = sub * static_cast<double>(1 + (r >> 8) % 7); break;
      default: {
        const double m = 1.0 + static_cast<double>((r >> 8) % 100000) / 100000.0;
        const int ex = static_cast<int>((r >> 30) % (2 * max_exp + 1)) - max_exp;
        d = std::ldexp((r >> 60) & 1 ? -m : m, ex);
      }
    }
    e = static_cast<T>(static_cast<float>(d));
    if constexpr (std::is_same_v<T, double>) e = d;
  }
  return v;
}

template <typename T>
double as_double(const T& v) {
  if constexpr (std::is_same_v<T, double>) return v;
  return static_cast<double>(static_cast<float>(v));
}

double f64(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

double unkey(int64_t k) { return f64(k >= 0 ? k : (k ^ INT64_MAX)); }

struct Hist {
  int64_t kind = kHistNone;  // kHistLog2 / kHistLinear
  int64_t lo = 0, hi = 0;    // log2 exponents
  double llo = 0, lhi = 0;   // linear range
  int64_t bins = 0;
  int64_t nbins() const {
    return kind == kHistNone ? 0 : kind == kHistLog2 ? hi - lo + 3 : bins + 2;
  }
  HistSpec spec() const {
    HistSpec h{};
    h.kind = kind;
    h.nbins = nbins();
    h.lo_exp = lo;
    h.hi_exp = hi;
    h.lo = llo;
    h.hi = lhi;
    h.bins = bins;
    h.width = kind == kHistLinear ? (lhi - llo) / static_cast<double>(bins) : 0.0;
    h.inv_width = kind == kHistLinear ? 1.0 / h.width : 0.0;
    return h;
  }
  // Reference bin: frexp exponents / the edge list, not the kernel's math.
  int64_t bin(double v) const {
    if (kind == kHistLog2) {
      const double a = std::fabs(v);
      if (a == 0) return 0;
      int e;
      std::frexp(a, &e);
      --e;
      return e < lo ? 1 : e >= hi ? hi - lo + 2 : 2 + (e - lo);
    }
    std::vector<double> edges(bins + 1);
    const double w = (lhi - llo) / static_cast<double>(bins);
    for (int64_t i = 0; i < bins; ++i) edges[i] = llo + static_cast<double>(i) * w;
    edges[bins] = lhi;
    return std::upper_bound(edges.begin(), edges.end(), v) - edges.begin();
  }
};

// Expected contents of one row after merging every value in `vals`.
// rtol: of the sums against sum |x| (and sum x^2): inputs of 32 bits or fewer
// are summed in float runs flushed to double, float64 in double.
void check_row(const char* name, const int64_t* row, const std::vector<double>& vals,
               int64_t calls, const Hist& h, double rtol) {
  int64_t nan = 0, pinf = 0, ninf = 0, zeros = 0, finite = 0;
  long double sum = 0, sumsq = 0, asum = 0;
  double mn = INFINITY, mx = -INFINITY, amx = -INFINITY;
  std::vector<int64_t> hist(h.nbins(), 0);
  for (const double v : vals) {
    if (std::isnan(v)) { ++nan; continue; }
    if (std::isinf(v)) { ++(v > 0 ? pinf : ninf); continue; }
    ++finite;
    zeros += v == 0;
    sum += v;
    sumsq += static_cast<long double>(v) * v;
    asum += std::fabs(v);
    mn = std::min(mn, v);
    mx = std::max(mx, v);
    amx = std::max(amx, std::fabs(v));
    if (h.kind != kHistNone) ++hist[h.bin(v)];
  }
  CHECK(row[kCount] == static_cast<int64_t>(vals.size()), "%s count %ld", name, row[kCount]);
  CHECK(row[kCalls] == calls, "%s calls %ld", name, row[kCalls]);
  CHECK(row[kNan] == nan, "%s nan %ld vs %ld", name, row[kNan], nan);
  CHECK(row[kPosInf] == pinf, "%s posinf %ld vs %ld", name, row[kPosInf], pinf);
  CHECK(row[kNegInf] == ninf, "%s neginf %ld vs %ld", name, row[kNegInf], ninf);
  CHECK(row[kZeros] == zeros, "%s zeros %ld vs %ld", name, row[kZeros], zeros);
  if (finite > 0) {
    CHECK(unkey(row[kMin]) == mn, "%s min %g vs %g", name, unkey(row[kMin]), mn);
    CHECK(unkey(row[kMax]) == mx, "%s max %g vs %g", name, unkey(row[kMax]), mx);
    CHECK(unkey(row[kAbsMax]) == amx, "%s absmax %g vs %g", name, unkey(row[kAbsMax]), amx);
    const double tol = rtol * static_cast<double>(asum) + 1e-300;
    CHECK(std::fabs(f64(row[kSum]) - static_cast<double>(sum)) <= tol, "%s sum %.17g vs %.17g",
          name, f64(row[kSum]), static_cast<double>(sum));
    CHECK(std::fabs(f64(row[kSumSq]) - static_cast<double>(sumsq)) <=
              rtol * static_cast<double>(sumsq) + 1e-300,
          "%s sumsq %.17g vs %.17g", name, f64(row[kSumSq]), static_cast<double>(sumsq));
    // Shifted moments agree with the raw sum: S1 = sum - finite * K.
    const double k = f64(row[kShift]);
    CHECK(std::fabs(f64(row[kS1]) - (static_cast<double>(sum) - finite * k)) <=
              rtol * (static_cast<double>(asum) + finite * std::fabs(k)) + 1e-300,
          "%s s1 %.17g (shift %g)", name, f64(row[kS1]), k);
  }
  for (int64_t b = 0; b < h.nbins(); ++b) {
    CHECK(row[kHeader + b] == hist[b], "%s hist[%ld] %ld vs %ld", name, b, row[kHeader + b],
          hist[b]);
  }
}

struct Ring {
  int64_t slots, rows, width;
  std::vector<int64_t> data;
  int64_t state[3] = {0, 1, 0};
  Ring(int64_t s, int64_t r, int64_t w) : slots(s), rows(r), width(w), data(s * r * w, 0x5a5a) {}
  int64_t* row(int64_t slot, int64_t r) { return data.data() + (slot * rows + r) * width; }
  // A launch that adds `count` elements and one call, each element read once;
  // its blocks merge by the tree (one scratch for every launch, as the
  // launcher's per stream).
  kernels::RowTarget target(int64_t r, int64_t count) {
    static std::vector<int64_t> scratch(kernels::tree_scratch_words(kernels::kMaxTreeBlocks), 0);
    return {data.data(), state, r, rows, width, slots, count, 1, 1, scratch.data()};
  }
  void reset(dim3 grid, dim3 block) {
    hookcap_emu::reset_slot(data.data(), state, slots, rows, width, grid, block);
  }
};

// Rows [r0, r1) of `slot` (default: all) hold the reset values for `step`.
void check_reset(const char* name, Ring& ring, int64_t slot, int64_t step, int64_t r0 = 0,
                 int64_t r1 = -1) {
  for (int64_t r = r0; r < (r1 < 0 ? ring.rows : r1); ++r) {
    const int64_t* row = ring.row(slot, r);
    for (int64_t c = 0; c < ring.width; ++c) {
      int64_t want = 0;
      if (c == kStepTag) want = step;
      if (c == kShift || c == kBigShift || c == kSmallShift) want = static_cast<int64_t>(0x7ff8dead0000beefULL);
      // Ordered keys: key(+inf) = bits(+inf); key(-inf) = bits(-inf) ^ INT64_MAX.
      if (c == kMin) want = 0x7ff0000000000000LL;
      if (c == kMax || c == kAbsMax) want = static_cast<int64_t>(0x800fffffffffffffULL);
      CHECK(row[c] == want, "%s slot %ld row %ld col %ld: %ld vs %ld", name, slot, r, c, row[c],
            want);
    }
  }
}

template <typename T>
constexpr double rtol_of() {
  return sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
}

// Accumulate `parts` (each written by its own launch) into one row and check.
template <typename T>
void scenario_dense(const char* name, int max_exp, double sub, std::vector<size_t> sizes,
                    size_t offset, const Hist& h, dim3 grid, dim3 block) {
  Ring ring(2, 3, kHeader + h.nbins());
  ring.state[2] = 1;  // writes must land in slot 1 only
  ring.reset(dim3(2), dim3(64));
  check_reset(name, ring, 1, 0);
  std::vector<double> all;
  for (const size_t n : sizes) {
    const std::vector<T> x = make_data<T>(n + offset, max_exp, sub);
    const T* p = x.data() + offset;  // misaligned start
    for (size_t i = 0; i < n; ++i) all.push_back(as_double(p[i]));
    hookcap_emu::accumulate<T>(p, static_cast<int64_t>(n), hookcap::kReadFlat, StridedDesc{}, ring.target(1, static_cast<int64_t>(n)),
                               h.spec(), grid, block);
  }
  check_row(name, ring.row(1, 1), all, static_cast<int64_t>(sizes.size()), h, rtol_of<T>());
  for (int64_t r : {0, 2}) {  // neighbouring rows untouched
    const int64_t* row = ring.row(1, r);
    CHECK(row[kCount] == 0 && row[kCalls] == 0, "%s row %ld written", name, r);
  }
  CHECK(ring.row(0, 1)[kCount] == 0x5a5a, "%s slot 0 written", name);
}

// A transposed-then-sliced 2-D view expanded along a middle dimension:
// sizes {rows, rep, cols}, strides {1, 0, ld}. The host plan walks it as
// {cols, rows} (sorted by stride) with multiplicity rep.
template <typename T>
void scenario_strided(const char* name, int64_t rows, int64_t rep, int64_t cols, int64_t ld,
                      const Hist& h, dim3 grid, dim3 block) {
  const std::vector<T> x = make_data<T>(static_cast<size_t>(ld * cols), 40, 1e-310);
  const int64_t sizes[3] = {rows, rep, cols}, strides[3] = {1, 0, ld};
  const hookcap::DimPlan plan = hookcap::plan_dims(3, sizes, strides);
  CHECK(!plan.flat && plan.mult == rep && plan.desc.ndim == 2 && plan.desc.strides[1] == 1,
        "%s: plan flat=%d mult=%ld ndim=%ld", name, plan.flat, plan.mult, plan.desc.ndim);
  // Element (i, r, j) at i + j*ld.
  std::vector<double> all;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < rep; ++r) {
      for (int64_t j = 0; j < cols; ++j) all.push_back(as_double(x[i + j * ld]));
    }
  }
  Ring ring(1, 1, kHeader + h.nbins());
  ring.reset(dim3(1), dim3(32));
  kernels::RowTarget tgt = ring.target(0, rows * rep * cols);
  tgt.mult = plan.mult;
  hookcap_emu::accumulate<T>(x.data(), plan.visit, hookcap::kReadElements, plan.desc, tgt, h.spec(), grid, block);
  check_row(name, ring.row(0, 0), all, 1, h, rtol_of<T>());
}

// Rows of whole 16-byte vectors (a slice of each row of a rows x ld
// matrix, from column 8 on): read as vectors through a descriptor.
template <typename T>
void scenario_rows(const char* name, int64_t rows, int64_t cols, int64_t ld, const Hist& h, dim3 grid,
                   dim3 block) {
  const std::vector<T> x = make_data<T>(static_cast<size_t>(ld * rows), 40, 1e-40);
  const int64_t sizes[2] = {rows, cols}, strides[2] = {ld, 1};
  const hookcap::DimPlan plan = hookcap::plan_dims(2, sizes, strides);
  const T* p = x.data() + 8;
  hookcap::StridedDesc vec;
  hookcap::RowTails tails;
  CHECK(hookcap::vector_read(plan, sizeof(T), reinterpret_cast<uintptr_t>(p), vec, tails) == hookcap::kReadVectors &&
            tails.visit == 0,
        "%s: not read as whole vectors", name);
  std::vector<double> all;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) all.push_back(as_double(p[i * ld + j]));
  }
  Ring ring(1, 1, kHeader + h.nbins());
  ring.reset(dim3(1), dim3(32));
  hookcap_emu::accumulate<T>(p, plan.visit, hookcap::kReadVectors, vec, ring.target(0, rows * cols), h.spec(),
                             grid, block);
  check_row(name, ring.row(0, 0), all, 1, h, rtol_of<T>());
}

// Tiny finite values (|x| in [2**-100, 2**-60], zeros among them): every
// float run's squares underflow, so each run is summed again scaled by a
// power of two.
template <typename T>
void scenario_tiny(const char* name, size_t n, const Hist& h, dim3 grid, dim3 block) {
  std::vector<T> x(n);
  std::vector<double> all;
  for (auto& e : x) {
    const uint64_t r = next_u64();
    const double m = 1.0 + static_cast<double>((r >> 8) % 100000) / 100000.0;
    const double d = r % 16 == 0 ? 0.0 : std::ldexp((r >> 60) & 1 ? -m : m, -60 - static_cast<int>((r >> 30) % 41));
    e = static_cast<T>(static_cast<float>(d));
    all.push_back(as_double(e));
  }
  Ring ring(1, 1, kHeader + h.nbins());
  ring.reset(dim3(1), dim3(32));
  hookcap_emu::accumulate<T>(x.data(), static_cast<int64_t>(n), hookcap::kReadFlat, StridedDesc{},
                             ring.target(0, static_cast<int64_t>(n)), h.spec(), grid, block);
  check_row(name, ring.row(0, 0), all, 1, h, rtol_of<T>());
}

void scenario_state() {
  Ring ring(3, 2, kHeader + 4);
  ring.reset(dim3(1), dim3(32));
  // every = 1: each step is recorded and takes the next slot (mod 3).
  for (int64_t step = 1; step <= 4; ++step) {
    hookcap_emu::advance(ring.data.data(), ring.state, 3, 2, ring.width, 1, dim3(3), dim3(128));
    CHECK(ring.state[0] == step && ring.state[1] == 1 && ring.state[2] == step % 3,
          "advance every=1 step %ld: state (%ld, %ld, %ld)", step, ring.state[0], ring.state[1],
          ring.state[2]);
    check_reset("advance every=1", ring, step % 3, step);
  }
  // every = 3 from step 4 (slot 1): steps 5, 7 are off; 6 takes slot 2.
  std::vector<int64_t> before = ring.data;
  hookcap_emu::advance(ring.data.data(), ring.state, 3, 2, ring.width, 3, dim3(2), dim3(64));
  CHECK(ring.state[0] == 5 && ring.state[1] == 0 && ring.state[2] == 1, "every=3 step 5");
  CHECK(ring.data == before, "an off step reset a slot");
  // Disabled step: accumulate writes nothing.
  const std::vector<float> x = make_data<float>(300, 10, 1e-40);
  Hist none;
  hookcap_emu::accumulate<float>(x.data(), 300, hookcap::kReadFlat, StridedDesc{}, ring.target(0, 300),
                                 none.spec(), dim3(2), dim3(64));
  CHECK(ring.data == before, "accumulate wrote while disabled");
  // One block narrower than the slot: each thread resets several words (the column walk wraps).
  hookcap_emu::advance(ring.data.data(), ring.state, 3, 2, ring.width, 3, dim3(1), dim3(32));
  CHECK(ring.state[0] == 6 && ring.state[1] == 1 && ring.state[2] == 2, "every=3 step 6");
  check_reset("advance every=3", ring, 2, 6);
  // reset_rows: row 1 of slot 2 only.
  std::fill(ring.data.begin(), ring.data.end(), 77);
  hookcap_emu::reset_rows(ring.data.data(), ring.state, ring.slots, 2, ring.width, 1, 2, dim3(2),
                          dim3(32));
  check_reset("reset_rows", ring, 2, 6, 1, 2);
  CHECK(std::count(ring.data.begin(), ring.data.end(), 77) ==
            static_cast<long>(ring.data.size()) - ring.width,
        "reset_rows wrote outside its row");
}

}  // namespace

int main(int argc, char** argv) {
  // argv[1]: block order 0 forward, 1 reverse, 2 shuffled (default);
  // argv[2]: schedule 0 concurrent (default), 1 warp-serial, 2 reversed.
  // argv[3]: a fault to commit (emu::Fault: none, index, sync, reset_walk, ticket, rescale).
  const int order = argc > 1 ? std::atoi(argv[1]) : 2;
  const int schedule = argc > 2 ? std::atoi(argv[2]) : 0;
  const std::string fault = argc > 3 ? argv[3] : "none";
  const char* faults[] = {"none", "index", "sync", "reset_walk", "ticket", "rescale"};
  bool known = false;
  for (int i = 0; i < 6; ++i) {
    if (fault == faults[i]) {
      emu::fault() = static_cast<emu::Fault>(i);
      known = true;
    }
  }
  if (!known) {
    std::printf("unknown fault %s\n", fault.c_str());
    return 2;
  }
  emu::set_config(emu::Config{static_cast<emu::BlockOrder>(order), 12345,
                              static_cast<emu::Schedule>(schedule)});
  try {
    Hist log2;
    log2.kind = kHistLog2;
    log2.lo = -64;
    log2.hi = 64;
    Hist lin;
    lin.kind = kHistLinear;
    lin.llo = -3.0;
    lin.lhi = 5.0;
    lin.bins = 13;
    Hist wide = lin;  // thresholds beyond the budget: counts in the ring, bins in double
    wide.bins = 20000;
    Hist wide_shared = lin;  // counts in the ring, thresholds in dynamic shared memory
    wide_shared.bins = 10000;
    const emu::Stats s0 = emu::stats();
    scenario_dense<float>("float32 misaligned x2", 60, 1e-41, {3001, 517}, 1, log2, dim3(3),
                          dim3(128));
    scenario_dense<double>("float64 misaligned", 300, 1e-310, {2049}, 1, lin, dim3(2), dim3(64));
    scenario_dense<c10::Half>("float16", 14, 1e-7, {1531}, 3, wide, dim3(2), dim3(96));
    scenario_dense<c10::BFloat16>("bfloat16", 60, 1e-40, {777}, 1, log2, dim3(1), dim3(256));
    // 40 blocks: two levels of the tree, three launches on one scratch.
    scenario_dense<float>("float32 two levels", 60, 1e-41, {9000, 4000, 2500}, 0, log2, dim3(40), dim3(32));
    scenario_dense<c10::BFloat16>("bfloat16 wide", 3, 1e-40, {1999}, 1, wide_shared, dim3(2), dim3(64));
    scenario_strided<float>("float32 strided", 37, 3, 23, 41, log2, dim3(2), dim3(64));
    scenario_rows<c10::BFloat16>("bfloat16 rows", 90, 24, 40, lin, dim3(2), dim3(64));
    scenario_tiny<float>("float32 tiny", 4000, log2, dim3(2), dim3(64));
    scenario_tiny<c10::BFloat16>("bfloat16 tiny", 3000, lin, dim3(1), dim3(64));
    scenario_state();
    const emu::Stats s1 = emu::stats();
    // advance: its reset's grid and one block for the state, 4 x (3 + 1) + (2 + 1) + (1 + 1).
    CHECK(s1.blocks - s0.blocks == 33 + 4 + 3 - 6 + 21 + 2 + 120 + 5, "blocks run: %lu", s1.blocks - s0.blocks);
  } catch (const emu::KernelFault& e) {
    std::printf("KERNEL FAULT: %s\n", e.what());
    return 3;
  }
  std::printf("%s: %d mismatches\n", g_failures ? "FAILED" : "ok", g_failures);
  return g_failures ? 1 : 0;
}
