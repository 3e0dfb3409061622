// cuda_emu.h: execute CUDA device code on the CPU, for tests (issue 8).
//
// Include this header, then a kernel header (csrc/cuda/*.cuh), and compile
// with g++ -std=c++20 as host code. emu::launch(kernel, grid, block, 0, args...)
// runs the launch's blocks ONE AT A TIME, each with blockDim real std::threads,
// so barriers, warp primitives and atomics run with real concurrency and
// ThreadSanitizer can check them. What is emulated, and how:
//  - __shared__ is `static`: one copy per kernel (instantiation), used by the
//    threads of the block being run. That is why blocks run one at a time and
//    launches are serialised. Contents persist from the previous block (real
//    shared memory starts undefined).
//  - Dynamic shared memory (the launch's shared_bytes, at most 227 KB as on
//    sm_90): one buffer per launch, reached through emu::dynamic_smem() (the
//    kernel's `extern __shared__` array; kernels written for both include a
//    shim, see csrc/cuda/stats_kernel.cuh). It is filled with a poison byte
//    before each block (real shared memory starts undefined) and followed by
//    a canary: a block that writes past the end fails the launch.
//  - Block order is configurable (forward / reverse / seeded shuffle) so that
//    results that depend on which block runs first show up.
//  - Schedule (Config::schedule): all threads of a block at once (default;
//    the one to run under TSan), or one warp at a time between barriers
//    (warp 0 first or last), which makes a missing __syncthreads give wrong
//    results deterministically.
//  - __syncthreads(): barrier over the block's live threads (exited threads
//    drop out). All threads of one barrier phase must arrive from the same
//    call site, else the launch fails ("divergent __syncthreads").
//  - Warp primitives (__shfl*_sync, __ballot_sync, __any/__all_sync,
//    __match_any_sync, __syncwarp): barrier + value exchange over the warp's live lanes, so
//    every live lane must take part with the same mask (a primitive over part
//    of a live warp is not emulated: it ends as a "deadlock" fault). They
//    order memory within the warp, like __syncwarp.
//  - Atomics: std::atomic_ref with memory_order_relaxed (CUDA atomics order
//    nothing else, so TSan must not see them as synchronisation).
//  - A launch where every live thread waits at a barrier that can never
//    complete fails with "deadlock" instead of hanging.
// Not emulated (using them does not compile or fails the launch): __constant__,
// textures, cooperative groups, clusters, streams, the opt-in attribute for
// more than 48 KB of shared memory (any size up to the sm_90 limit launches);
// timing, occupancy and the hardware memory model.
#pragma once

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#error "cuda_emu.h is for host compilers; nvcc compiles the real kernels"
#endif
// Kernel headers test this to take the harness's dynamic shared memory.
#define HOOKCAP_CUDA_EMU 1
#define HOOKCAP_EMU_FAULT(name) (::emu::fault() == ::emu::Fault::name)

#include <algorithm>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <source_location>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
// __restrict__ is a GCC keyword already.

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

namespace emu {

// A kernel fault (divergent barrier, deadlock, bad warp mask, __trap, an
// exception in a thread): the launch throws this.
struct KernelFault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class BlockOrder { kForward = 0, kReverse = 1, kShuffle = 2 };

// kConcurrent: all threads of a block run at once (use this under TSan).
// kWarpSerial / kWarpSerialReverse: one warp at a time between block barriers
// (warp 0 first / last): a deterministic worst case for a missing
// __syncthreads, since the running warp reads shared memory before any later
// warp has written it. Handing the turn over synchronises the warps, so TSan
// sees no cross-warp race in these schedules.
enum class Schedule { kConcurrent = 0, kWarpSerial = 1, kWarpSerialReverse = 2 };

struct Config {
  BlockOrder order = BlockOrder::kForward;
  uint64_t seed = 0;  // for kShuffle
  Schedule schedule = Schedule::kConcurrent;
};

// A fault the kernels can be told to commit (HOOKCAP_EMU_FAULT in
// stats_kernel.cuh): proof that the tests catch it. Set before launches,
// read-only while they run.
enum class Fault { none, index, sync, reset_walk, ticket, rescale, update_bias, key_sign, m4_rebase };

inline Fault& fault() {
  static Fault f = Fault::none;
  return f;
}

// Counters, so tests can assert that a launch really ran what they asked.
struct Stats {
  uint64_t launches = 0, blocks = 0, threads = 0, barrier_phases = 0, warp_phases = 0;
  uint64_t device_atomics = 0;  // global-memory atomics the kernel counted (note_device_atomic)
};

namespace detail {

constexpr auto kRelaxed = std::memory_order_relaxed;

struct Site {
  const char* what = "";
  const char* file = "";
  unsigned line = 0;
  unsigned column = 0;
  unsigned mask = 0;
  bool operator==(const Site& o) const {
    return line == o.line && column == o.column && mask == o.mask &&
           std::strcmp(what, o.what) == 0 && std::strcmp(file, o.file) == 0;
  }
  std::string str() const {
    char m[32] = "";
    if (mask != 0) std::snprintf(m, sizeof m, " (mask 0x%08x)", mask);
    return std::string(what) + m + " at " + file + ":" + std::to_string(line);
  }
};

inline Site make_site(const char* what, const std::source_location& l, unsigned mask = 0) {
  return Site{what, l.file_name(), static_cast<unsigned>(l.line()),
              static_cast<unsigned>(l.column()), mask};
}

// One barrier: the block's (__syncthreads) or one warp's (warp primitives).
// Warp exchange slots are double-buffered by phase parity: a lane can only
// overwrite parity p again after every lane has passed the phase in between.
struct Sync {
  std::mutex mu;
  std::condition_variable cv;
  unsigned expected = 0;  // live participants
  unsigned arrived = 0;
  uint64_t gen = 0;
  Site site;
  uint32_t live = 0;               // warp: live lanes
  uint32_t arrived_mask[2] = {0, 0};
  uint64_t slot[2][32] = {};
  bool is_warp = false;
};

struct Stat {
  std::atomic<uint64_t> launches{0}, blocks{0}, threads{0}, barrier_phases{0}, warp_phases{0};
  std::atomic<uint64_t> device_atomics{0};
};
inline Stat& stat() {
  static Stat s;
  return s;
}

class Block;
struct ThreadCtx {
  Block* block;
  unsigned tid, warp, lane;
};
inline thread_local ThreadCtx* tctx = nullptr;

inline ThreadCtx& ctx() {
  if (tctx == nullptr) throw std::logic_error("emu: device code called outside emu::launch");
  return *tctx;
}

class Block {
 public:
  Block(unsigned nthreads, Schedule schedule)
      : nwarps_((nthreads + 31) / 32), warps_(nwarps_), turns_(nwarps_) {
    counts_.store(static_cast<uint64_t>(nthreads) << 32, kRelaxed);
    block_.expected = nthreads;
    for (unsigned w = 0; w < nwarps_; ++w) {
      const unsigned lanes = std::min(32u, nthreads - 32 * w);
      warps_[w].expected = lanes;
      warps_[w].live = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
      warps_[w].is_warp = true;
      turns_[w].live = lanes;
      order_.push_back(w);
    }
    serial_ = schedule != Schedule::kConcurrent;
    if (schedule == Schedule::kWarpSerialReverse) std::reverse(order_.begin(), order_.end());
    turn_ = static_cast<int>(order_[0]);
  }

  Sync& block_sync() { return block_; }
  Sync& warp_sync(unsigned w) { return warps_[w]; }
  bool poisoned() const { return poisoned_.load(); }

  std::string error() {
    std::lock_guard<std::mutex> g(err_mu_);
    return error_;
  }

  // Record the first error, then wake every waiter so the launch unwinds.
  void fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> g(err_mu_);
      if (error_.empty()) error_ = msg;
    }
    poisoned_.store(true);
    wake(block_);
    for (auto& w : warps_) wake(w);
    std::lock_guard<std::mutex> g(turn_mu_);
    turn_cv_.notify_all();
  }

  // Warp-serial schedules: wait until this thread's warp may run.
  void wait_turn(unsigned w) {
    if (!serial_) return;
    std::unique_lock<std::mutex> lk(turn_mu_);
    if (turn_ == static_cast<int>(w)) return;
    ++turns_[w].waiting;
    const uint64_t c = counts_.fetch_add(1, kRelaxed) + 1;
    if ((c & 0xffffffffu) == (c >> 32)) {
      lk.unlock();
      fault("deadlock: every live thread waits; " + describe_waits());
    }
    turn_cv_.wait(lk, [&] { return turn_ == static_cast<int>(w) || poisoned(); });
    if (turn_ != static_cast<int>(w)) throw KernelFault("emu: launch aborted");
  }

  // What a lane sees of a completed phase. The slots of parity p stay as they
  // are until every lane has passed the next phase, which this lane enters
  // only after reading them, so they can be read after the lock is dropped.
  struct Phase {
    const uint64_t* slots;
    uint32_t arrived;
  };

  // Arrive at `s` with this lane's `value` and wait until the phase completes.
  Phase sync(Sync& s, const Site& site, unsigned lane, uint64_t value) {
    std::unique_lock<std::mutex> lk(s.mu);
    if (poisoned()) throw KernelFault("emu: launch aborted");
    if (s.is_warp && ((site.mask >> lane) & 1u) == 0) {
      lk.unlock();
      fault(site.str() + ": lane " + std::to_string(lane) + " is not in its mask");
    }
    const uint64_t g = s.gen;
    const unsigned p = static_cast<unsigned>(g & 1);
    if (s.arrived == 0) {
      s.site = site;
      s.arrived_mask[p] = 0;
    } else if (!(s.site == site)) {
      const std::string first = s.site.str();
      lk.unlock();
      fault(std::string("divergent ") + (s.is_warp ? "warp primitive" : "__syncthreads") +
            ": one phase reached from " + first + " and " + site.str());
    }
    s.slot[p][lane] = value;
    s.arrived_mask[p] |= 1u << lane;
    if (++s.arrived == s.expected) {
      release(s, s.arrived - 1);
    } else {
      const uint64_t c = counts_.fetch_add(1, kRelaxed) + 1;
      if ((c & 0xffffffffu) == (c >> 32)) {  // every live thread is waiting
        lk.unlock();
        fault("deadlock: every live thread waits at a barrier that cannot complete; " +
              describe_waits());
      }
      s.cv.wait(lk, [&] { return s.gen != g || poisoned(); });
      if (s.gen == g) throw KernelFault("emu: launch aborted");
    }
    return Phase{s.slot[p], s.arrived_mask[p]};
  }

  // A lane of warp w reached the block barrier (or exited): when the whole
  // warp has, the next warp in order gets the turn.
  void park(unsigned w, bool exiting) {
    if (!serial_) return;
    std::lock_guard<std::mutex> g(turn_mu_);
    if (exiting) {
      --turns_[w].live;
    } else {
      ++turns_[w].parked;
    }
    if (turn_ == static_cast<int>(w) && turns_[w].parked == turns_[w].live) {
      const auto at = std::find(order_.begin(), order_.end(), w);
      give_turn(at + 1);
    }
  }

  // A thread returned: it leaves its warp's and the block's barriers.
  void exit_thread(const ThreadCtx& c) {
    drop(warps_[c.warp], c.lane);
    drop(block_, c.lane);
    park(c.warp, true);  // before the live count drops: it may hand over the turn
    const uint64_t v = counts_.fetch_sub(uint64_t{1} << 32, kRelaxed) - (uint64_t{1} << 32);
    const uint64_t alive = v >> 32, blocked = v & 0xffffffffu;
    if (alive > 0 && blocked == alive && !poisoned()) {
      fail("deadlock: every live thread waits at a barrier that cannot complete; " +
           describe_waits());
    }
  }

  [[noreturn]] void fault(const std::string& msg) {
    fail(msg);
    throw KernelFault(msg);
  }

 private:
  // Hand the turn to the first warp from `from` on that still has lanes to
  // run (under turn_mu_). None left: every live lane is at the barrier.
  void give_turn(std::vector<unsigned>::iterator from) {
    turn_ = -1;
    for (auto it = from; it != order_.end(); ++it) {
      Turn& t = turns_[*it];
      if (t.live > t.parked) {
        turn_ = static_cast<int>(*it);
        counts_.fetch_sub(t.waiting, kRelaxed);
        t.waiting = 0;
        break;
      }
    }
    turn_cv_.notify_all();
  }

  void release(Sync& s, unsigned waiters) {
    if (serial_ && &s == &block_) {  // barrier done: warps run again, in order
      std::lock_guard<std::mutex> g(turn_mu_);
      for (auto& t : turns_) t.parked = 0;
      give_turn(order_.begin());
    }
    s.arrived = 0;
    ++s.gen;
    counts_.fetch_sub(waiters, kRelaxed);
    (s.is_warp ? stat().warp_phases : stat().barrier_phases).fetch_add(1, kRelaxed);
    s.cv.notify_all();
  }

  void drop(Sync& s, unsigned lane) {
    std::lock_guard<std::mutex> g(s.mu);
    --s.expected;
    if (s.is_warp) s.live &= ~(1u << lane);
    if (s.arrived > 0 && s.arrived == s.expected) release(s, s.arrived);
  }

  static void wake(Sync& s) {
    std::lock_guard<std::mutex> g(s.mu);
    s.cv.notify_all();
  }

  std::string describe_waits() {
    std::string out;
    auto one = [&](Sync& s, const std::string& name) {
      std::lock_guard<std::mutex> g(s.mu);
      if (s.arrived == 0) return;
      out += name + ": " + std::to_string(s.arrived) + "/" + std::to_string(s.expected) +
             " at " + s.site.str() + "; ";
    };
    one(block_, "block barrier");
    for (unsigned w = 0; w < nwarps_; ++w) one(warps_[w], "warp " + std::to_string(w));
    return out;
  }

  struct Turn {
    unsigned live = 0, parked = 0, waiting = 0;
  };

  unsigned nwarps_;
  Sync block_;
  std::vector<Sync> warps_;
  bool serial_ = false;
  std::vector<unsigned> order_;  // warp order of the serial schedules
  std::vector<Turn> turns_;
  int turn_ = -1;
  std::mutex turn_mu_;
  std::condition_variable turn_cv_;
  std::atomic<uint64_t> counts_{0};  // live threads << 32 | threads waiting
  std::atomic<bool> poisoned_{false};
  std::mutex err_mu_;
  std::string error_;
};

inline Config& config() {
  static Config c;
  return c;
}

// The running launch's dynamic shared memory (launches are serialised).
constexpr size_t kMaxDynamicSmem = 232448;  // 227 KB: sm_90's per-block maximum
constexpr size_t kSmemCanary = 64;
constexpr unsigned char kSmemPoison = 0xa5, kSmemCanaryByte = 0x3c;
struct DynamicSmem {
  std::vector<unsigned char> buf;  // shared_bytes + kSmemCanary
  size_t bytes = 0;
};
inline DynamicSmem& dyn_smem() {
  static DynamicSmem d;
  return d;
}
inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

inline void run_block(const dim3& grid, const dim3& block, const uint3& bidx,
                      const std::function<void()>& body) {
  const unsigned n = block.x * block.y * block.z;
  DynamicSmem& dsm = dyn_smem();
  std::fill(dsm.buf.begin(), dsm.buf.begin() + static_cast<std::ptrdiff_t>(dsm.bytes), kSmemPoison);
  std::fill(dsm.buf.begin() + static_cast<std::ptrdiff_t>(dsm.bytes), dsm.buf.end(), kSmemCanaryByte);
  Block b(n, config().schedule);
  std::vector<std::thread> threads;
  threads.reserve(n);
  try {
    for (unsigned t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        ThreadCtx c{&b, t, t / 32, t % 32};
        tctx = &c;
        threadIdx = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        blockIdx = bidx;
        blockDim = block;
        gridDim = grid;
        try {
          b.wait_turn(c.warp);
          body();
        } catch (const KernelFault& e) {
          b.fail(e.what());  // no-op if already recorded
        } catch (const std::exception& e) {
          b.fail(std::string("exception in a device thread: ") + e.what());
        } catch (...) {
          b.fail("unknown exception in a device thread");
        }
        b.exit_thread(c);
        tctx = nullptr;
      });
    }
  } catch (const std::system_error& e) {
    b.fail(std::string("emu: could not start block threads: ") + e.what());
  }
  for (auto& th : threads) th.join();
  if (std::any_of(dsm.buf.begin() + static_cast<std::ptrdiff_t>(dsm.bytes), dsm.buf.end(),
                  [](unsigned char c) { return c != kSmemCanaryByte; })) {
    b.fail("wrote past the end of its " + std::to_string(dsm.bytes) +
           " bytes of dynamic shared memory");
  }
  stat().blocks.fetch_add(1, kRelaxed);
  stat().threads.fetch_add(n, kRelaxed);
  const std::string err = b.error();
  if (!err.empty()) {
    throw KernelFault("emu: block (" + std::to_string(bidx.x) + "," + std::to_string(bidx.y) +
                      "," + std::to_string(bidx.z) + "): " + err);
  }
}

inline void run_grid(dim3 grid, dim3 block, size_t shared_bytes,
                     const std::function<void()>& body) {
  const uint64_t nthreads = uint64_t{block.x} * block.y * block.z;
  if (nthreads == 0 || nthreads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
      grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) {
    throw std::invalid_argument("emu::launch: invalid configuration argument");
  }
  if (shared_bytes > kMaxDynamicSmem) {
    throw std::invalid_argument("emu::launch: " + std::to_string(shared_bytes) +
                                " bytes of dynamic shared memory exceed the " +
                                std::to_string(kMaxDynamicSmem) + "-byte limit");
  }
  std::lock_guard<std::mutex> lk(launch_mutex());  // __shared__ is static
  dyn_smem().bytes = shared_bytes;
  dyn_smem().buf.assign(shared_bytes + kSmemCanary, kSmemCanaryByte);
  const uint64_t nblocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> order(nblocks);
  std::iota(order.begin(), order.end(), uint64_t{0});
  if (config().order == BlockOrder::kReverse) std::reverse(order.begin(), order.end());
  if (config().order == BlockOrder::kShuffle) {
    std::mt19937_64 rng(config().seed);
    std::shuffle(order.begin(), order.end(), rng);
  }
  stat().launches.fetch_add(1, kRelaxed);
  for (const uint64_t lin : order) {
    const uint3 bidx{static_cast<unsigned>(lin % grid.x),
                     static_cast<unsigned>((lin / grid.x) % grid.y),
                     static_cast<unsigned>(lin / (uint64_t{grid.x} * grid.y))};
    run_block(grid, block, bidx, body);
  }
}

template <typename T>
uint64_t to_bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// One warp-synchronous step of the calling lane.
inline Block::Phase warp_step(const Site& site, uint64_t value) {
  ThreadCtx& c = ctx();
  return c.block->sync(c.block->warp_sync(c.warp), site, c.lane, value);
}

// Value of lane `src` in a completed shuffle phase; the lane must have taken part.
template <typename T>
T lane_value(const Site& site, const Block::Phase& ph, unsigned src) {
  if (src >= 32 || ((ph.arrived >> src) & 1u) == 0 || ((site.mask >> src) & 1u) == 0) {
    ctx().block->fault(site.str() + ": reads lane " + std::to_string(src) +
                       ", which is not in the mask or did not take part");
  }
  return from_bits<T>(ph.slots[src]);
}

inline void check_width(int width) {
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    ctx().block->fault("shuffle width must be a power of 2 in [1, 32], got " +
                       std::to_string(width));
  }
}

template <typename T>
std::atomic_ref<T> aref(T* p) {
  return std::atomic_ref<T>(*p);
}

template <typename T, typename F>
T cas_update(T* p, F f) {
  auto r = aref(p);
  T old = r.load(kRelaxed);
  while (!r.compare_exchange_weak(old, f(old), kRelaxed, kRelaxed)) {
  }
  return old;
}

}  // namespace detail

inline void set_config(const Config& c) {
  std::lock_guard<std::mutex> lk(detail::launch_mutex());
  detail::config() = c;
}

// The running block's dynamic shared memory (`extern __shared__` in CUDA):
// the launch's shared_bytes, 16-byte aligned.
inline unsigned char* dynamic_smem() {
  (void)detail::ctx();  // device code only
  return detail::dyn_smem().buf.data();
}

inline Stats stats() {
  auto& s = detail::stat();
  return Stats{s.launches.load(), s.blocks.load(), s.threads.load(), s.barrier_phases.load(),
               s.warp_phases.load(), s.device_atomics.load()};
}

// Kernels call this once per atomic on global memory (the harness cannot
// tell global from shared addresses), so tests can count a launch's.
inline void note_device_atomic() { detail::stat().device_atomics.fetch_add(1, detail::kRelaxed); }

// kernel<<<grid, block, shared_bytes>>>(args...), synchronously. Arguments are
// converted to the kernel's parameter types once, as CUDA does at launch;
// every thread gets its own by-value copy. Throws KernelFault on a fault.
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "emu::launch: wrong number of kernel arguments");
  const std::tuple<std::decay_t<P>...> params(
      static_cast<std::decay_t<P>>(std::forward<A>(args))...);
  detail::run_grid(grid, block, shared_bytes, [&] { std::apply(kernel, params); });
}

}  // namespace emu

// ---------------------------------------------------------------------------
// Device intrinsics.
// ---------------------------------------------------------------------------
inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  auto& c = emu::detail::ctx();
  c.block->park(c.warp, false);
  c.block->sync(c.block->block_sync(), emu::detail::make_site("__syncthreads", loc), c.lane, 0);
  c.block->wait_turn(c.warp);
}

inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location loc = std::source_location::current()) {
  emu::detail::warp_step(emu::detail::make_site("__syncwarp", loc, mask), 0);
}

// The types CUDA's __shfl*_sync accept (besides __half/__half2).
template <typename T>
concept EmuShflType =
    std::is_same_v<T, int> || std::is_same_v<T, unsigned int> || std::is_same_v<T, long> ||
    std::is_same_v<T, unsigned long> || std::is_same_v<T, long long> ||
    std::is_same_v<T, unsigned long long> || std::is_same_v<T, float> ||
    std::is_same_v<T, double>;

template <EmuShflType T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              std::source_location loc = std::source_location::current()) {
  using namespace emu::detail;
  check_width(width);
  const Site site = make_site("__shfl_sync", loc, mask);
  const unsigned lane = ctx().lane;
  const unsigned src = (lane & ~static_cast<unsigned>(width - 1)) +
                       (static_cast<unsigned>(src_lane) & static_cast<unsigned>(width - 1));
  return lane_value<T>(site, warp_step(site, to_bits(var)), src);
}

template <EmuShflType T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   std::source_location loc = std::source_location::current()) {
  using namespace emu::detail;
  check_width(width);
  const Site site = make_site("__shfl_down_sync", loc, mask);
  const unsigned lane = ctx().lane;
  const unsigned w = static_cast<unsigned>(width);
  const unsigned src = (lane % w) + delta < w ? lane + delta : lane;
  return lane_value<T>(site, warp_step(site, to_bits(var)), src);
}

template <EmuShflType T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 std::source_location loc = std::source_location::current()) {
  using namespace emu::detail;
  check_width(width);
  const Site site = make_site("__shfl_up_sync", loc, mask);
  const unsigned lane = ctx().lane;
  const unsigned src = (lane % static_cast<unsigned>(width)) >= delta ? lane - delta : lane;
  return lane_value<T>(site, warp_step(site, to_bits(var)), src);
}

template <EmuShflType T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  std::source_location loc = std::source_location::current()) {
  using namespace emu::detail;
  check_width(width);
  const Site site = make_site("__shfl_xor_sync", loc, mask);
  const unsigned lane = ctx().lane;
  const unsigned w = static_cast<unsigned>(width);
  unsigned src = lane ^ static_cast<unsigned>(lane_mask);
  if (src / w != lane / w) src = lane;  // outside the lane's segment
  return lane_value<T>(site, warp_step(site, to_bits(var)), src);
}

namespace emu::detail {
// (ballot over the mask's participating lanes, those lanes).
inline std::pair<unsigned, unsigned> ballot(const Site& site, int pred) {
  const Block::Phase ph = warp_step(site, pred != 0 ? 1u : 0u);
  const unsigned lanes = ph.arrived & site.mask;
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if ((lanes >> l) & 1u) r |= (ph.slots[l] != 0 ? 1u : 0u) << l;
  }
  return {r, lanes};
}
}  // namespace emu::detail

inline unsigned __ballot_sync(unsigned mask, int pred,
                              std::source_location loc = std::source_location::current()) {
  return emu::detail::ballot(emu::detail::make_site("__ballot_sync", loc, mask), pred).first;
}

inline int __any_sync(unsigned mask, int pred,
                      std::source_location loc = std::source_location::current()) {
  return emu::detail::ballot(emu::detail::make_site("__any_sync", loc, mask), pred).first != 0;
}

inline int __all_sync(unsigned mask, int pred,
                      std::source_location loc = std::source_location::current()) {
  const auto [r, lanes] =
      emu::detail::ballot(emu::detail::make_site("__all_sync", loc, mask), pred);
  return r == lanes;
}

// Mask of the lanes in `mask` whose `value` has the same bits as this lane's.
template <EmuShflType T>
unsigned __match_any_sync(unsigned mask, T value,
                          std::source_location loc = std::source_location::current()) {
  using namespace emu::detail;
  const Site site = make_site("__match_any_sync", loc, mask);
  const uint64_t mine = to_bits(value);
  const Block::Phase ph = warp_step(site, mine);
  const unsigned lanes = ph.arrived & site.mask;
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if (((lanes >> l) & 1u) != 0 && ph.slots[l] == mine) r |= 1u << l;
  }
  return r;
}

// Lanes of the warp that have not exited (the emulation has no notion of
// divergence, so this is the widest mask __activemask could return).
inline unsigned __activemask() {
  auto& c = emu::detail::ctx();
  auto& s = c.block->warp_sync(c.warp);
  std::lock_guard<std::mutex> g(s.mu);
  return s.live;
}

[[noreturn]] inline void __trap() { emu::detail::ctx().block->fault("__trap()"); }

// Fences. TSan does not model std::atomic_thread_fence (and warns at each
// use): under it they order nothing, so TSan still reports any race a kernel
// would rely on a fence to avoid. Blocks run one at a time, so what a block
// publishes past a fence for later blocks is ordered by the launch's joins.
#if defined(__SANITIZE_THREAD__)
inline void __threadfence() { std::atomic_signal_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_signal_fence(std::memory_order_seq_cst); }
#else
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#endif

template <typename T>
T __ldg(const T* p) {
  return *p;
}

inline long long __double_as_longlong(double v) { return std::bit_cast<long long>(v); }
inline double __longlong_as_double(long long v) { return std::bit_cast<double>(v); }
inline int __float_as_int(float v) { return std::bit_cast<int>(v); }
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline int __popc(unsigned v) { return std::popcount(v); }
// cvt.rzi.u32.f32: truncates, saturates (negative -> 0, >= 2**32 -> max), NaN -> 0.
inline unsigned __float2uint_rz(float v) {
  if (!(v > 0.0f)) return 0u;
  if (v >= 4294967296.0f) return 0xffffffffu;
  return static_cast<unsigned>(v);
}
inline int __popcll(unsigned long long v) { return std::popcount(v); }

// Atomics (relaxed, like CUDA's). Shared and global memory alike.
#define EMU_ATOMIC_RMW(NAME, T, OP) \
  inline T NAME(T* p, T v) { return emu::detail::aref(p).OP(v, emu::detail::kRelaxed); }
EMU_ATOMIC_RMW(atomicAdd, int, fetch_add)
EMU_ATOMIC_RMW(atomicAdd, unsigned int, fetch_add)
EMU_ATOMIC_RMW(atomicAdd, unsigned long long, fetch_add)
EMU_ATOMIC_RMW(atomicAdd, float, fetch_add)
EMU_ATOMIC_RMW(atomicAdd, double, fetch_add)
EMU_ATOMIC_RMW(atomicSub, int, fetch_sub)
EMU_ATOMIC_RMW(atomicSub, unsigned int, fetch_sub)
EMU_ATOMIC_RMW(atomicExch, int, exchange)
EMU_ATOMIC_RMW(atomicExch, unsigned int, exchange)
EMU_ATOMIC_RMW(atomicExch, unsigned long long, exchange)
EMU_ATOMIC_RMW(atomicExch, float, exchange)
EMU_ATOMIC_RMW(atomicAnd, int, fetch_and)
EMU_ATOMIC_RMW(atomicAnd, unsigned int, fetch_and)
EMU_ATOMIC_RMW(atomicAnd, unsigned long long, fetch_and)
EMU_ATOMIC_RMW(atomicOr, int, fetch_or)
EMU_ATOMIC_RMW(atomicOr, unsigned int, fetch_or)
EMU_ATOMIC_RMW(atomicOr, unsigned long long, fetch_or)
EMU_ATOMIC_RMW(atomicXor, int, fetch_xor)
EMU_ATOMIC_RMW(atomicXor, unsigned int, fetch_xor)
EMU_ATOMIC_RMW(atomicXor, unsigned long long, fetch_xor)
#undef EMU_ATOMIC_RMW

#define EMU_ATOMIC_MINMAX(T)                                                             \
  inline T atomicMin(T* p, T v) {                                                        \
    return emu::detail::cas_update(p, [v](T o) { return v < o ? v : o; });               \
  }                                                                                      \
  inline T atomicMax(T* p, T v) {                                                        \
    return emu::detail::cas_update(p, [v](T o) { return v > o ? v : o; });              \
  }                                                                                      \
  inline T atomicCAS(T* p, T compare, T val) {                                           \
    emu::detail::aref(p).compare_exchange_strong(compare, val, emu::detail::kRelaxed,    \
                                                 emu::detail::kRelaxed);                 \
    return compare; /* the old value */                                                  \
  }
EMU_ATOMIC_MINMAX(int)
EMU_ATOMIC_MINMAX(unsigned int)
EMU_ATOMIC_MINMAX(long long)
EMU_ATOMIC_MINMAX(unsigned long long)
#undef EMU_ATOMIC_MINMAX
