// CUDA launchers: pick grid/block, launch on the current stream (or
// hookcap's side stream, stats_stream) under a device guard. No allocation,
// no sync, no host read of device memory, so
// every launch is CUDA-graph capturable. The device code is in
// stats_kernel.cuh (also executed on the CPU by tests/cuda_emu).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <cuda/ptx>

#include "cuda/attention_kernel.cuh"
#include "cuda/attention_qk_kernel.cuh"
#include "cuda/attention_qk_plan.h"
#include "cuda/bins_kernel.cuh"
#include "cuda/many_plan.h"
#include "cuda/stats_kernel.cuh"
#include "cuda/update_plan.h"
#include "hookcap/op_checks.h"

namespace hookcap {
namespace {

constexpr int kThreads = kernels::kThreads;
constexpr int kBlocksPerSm = 4;
constexpr int64_t kPerThread = 64;
constexpr int kMaxDevices = 64;

// Grid bound: a few resident blocks per SM; the grid-stride loop covers the
// rest. SM counts are cached per device (attribute query is host-only).
int64_t max_blocks(int device) {
  // Hooks may launch from several threads: relaxed atomics (racing writers store the same value).
  static std::atomic<int> sms[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return kernels::kMaxTreeBlocks;
  int n = sms[device].load(std::memory_order_relaxed);
  if (n == 0) {
    int v = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    n = std::max(v, 1);
    sms[device].store(n, std::memory_order_relaxed);
  }
  return std::min<int64_t>(static_cast<int64_t>(n) * kBlocksPerSm, kernels::kMaxTreeBlocks);
}

// Streams that wrote a device's rings since the drain last joined them. A
// hook's op runs on the stream current where it ran (a user's side stream,
// a backward node on its forward's stream), not necessarily the one current
// at step(): the drain makes that one wait for all of them before it copies
// a slot to the host or advances the state. A write on a stream other than
// the one the last step() joined on records that stream's event right after
// its launch, so the join waits on events only and never touches a stream
// handle that may have been destroyed since (an external stream). Keys are
// handle + 1 (handles are aligned pointers or the small constants of the
// default streams; 0 = free).
constexpr int kMaxWriteStreams = 64;
struct WriteStreams {
  std::atomic<uintptr_t> keys[kMaxWriteStreams];
  std::atomic<cudaEvent_t> events[kMaxWriteStreams];  // created at a slot's first write
  std::atomic<bool> overflow;
  std::atomic<uintptr_t> step_stream;  // key of the stream current at the last join (0: none yet)
  std::mutex mu;                       // event creation
  cudaEvent_t step_event = nullptr;    // the last join's stream, when a step() runs on another
  cudaEvent_t side_event = nullptr;    // the side stream's work at a join
};
WriteStreams g_write_streams[kMaxDevices];

cudaEvent_t write_event(WriteStreams& w, int slot) {
  cudaEvent_t ev = w.events[slot].load(std::memory_order_acquire);
  if (ev != nullptr) return ev;
  std::lock_guard<std::mutex> lk(w.mu);
  ev = w.events[slot].load(std::memory_order_relaxed);
  if (ev == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    w.events[slot].store(ev, std::memory_order_release);
  }
  return ev;
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

// Ring buffers a CUDA graph capture wrote into: the graph keeps their
// address, so a ring that grows keeps such a buffer alive (hookcap/_ring.py),
// and a released one is parked for the process, never freed: an address
// here is never reused by another buffer. Added only while capturing.
std::mutex g_captured_mu;
std::vector<uintptr_t>* g_captured_rings = new std::vector<uintptr_t>();  // never freed: outlives exit

bool captured_locked(uintptr_t p) {  // g_captured_mu held
  for (const uintptr_t r : *g_captured_rings) {
    if (r == p) return true;
  }
  return false;
}

void note_capture(cudaStream_t s, const void* ring) {
  if (!capturing(s)) return;
  const auto p = reinterpret_cast<uintptr_t>(ring);
  std::lock_guard<std::mutex> lk(g_captured_mu);
  if (!captured_locked(p)) g_captured_rings->push_back(p);
}

// Monitor(stream="side") (hist_kind's kSideStreamFlag): statistics kernels
// run on hookcap's own stream of the device, made for it (not one of torch's
// pooled streams, which NCCL and torch.cuda.Stream() also draw from),
// non-blocking and at the lowest priority, so they can run beside the
// model's next kernels instead of between them. Each launch forks it from the
// current stream with an event (it waits for the capture's producer, no
// host sync), and marks its inputs used on it (record_stream): the caching
// allocator then keeps their memory from the next allocation until the
// kernels have read it. The drain joins it at step() (join_write_streams).
// Inside a CUDA graph capture launches stay on the capturing stream: a fork
// there would need a join before the capture ends.
struct SideStreams {
  std::once_flag made[kMaxDevices];
  std::atomic<c10::cuda::CUDAStream*> stream[kMaxDevices] = {};  // never destroyed
  std::atomic<bool> used[kMaxDevices] = {};        // launched on since the last join
};
SideStreams g_side;

c10::cuda::CUDAStream& side_stream(int device) {
  std::call_once(g_side.made[device], [device] {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    int lowest = 0, highest = 0;
    C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, lowest));  // kept for the process
    g_side.stream[device].store(
        new c10::cuda::CUDAStream(c10::cuda::getStreamFromExternal(s, static_cast<c10::DeviceIndex>(device))),
        std::memory_order_release);
  });
  return *g_side.stream[device].load(std::memory_order_acquire);
}

bool is_side_stream(int device, cudaStream_t s) {
  if (device < 0 || device >= kMaxDevices) return false;
  const c10::cuda::CUDAStream* side = g_side.stream[device].load(std::memory_order_acquire);
  return side != nullptr && side->stream() == s;
}

// The stream a statistics launch on `device` runs on (its guard set): the
// current one, or with `side` (outside a capture) the side stream forked
// from it, with every tensor `each_input` names marked used there.
template <typename EachInput>
cudaStream_t stats_stream(int device, bool side, EachInput&& each_input) {
  const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  if (!side || device < 0 || device >= kMaxDevices || capturing(cur)) return cur;
  c10::cuda::CUDAStream& s = side_stream(device);
  thread_local cudaEvent_t fork[kMaxDevices] = {};  // per thread: hooks launch from autograd's threads too
  if (fork[device] == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&fork[device], cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(fork[device], cur));
  C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), fork[device], 0));
  each_input([&](const at::Tensor& t) {
    if (t.defined() && t.is_cuda()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
  });
  g_side.used[device].store(true, std::memory_order_release);
  return s.stream();
}

cudaStream_t stats_stream(int device, bool side, std::initializer_list<const at::Tensor*> inputs) {
  return stats_stream(device, side, [&](auto&& keep) {
    for (const at::Tensor* t : inputs) keep(*t);
  });
}

// After every launch that writes a ring (outside a capture, whose graph
// orders its own streams): on a stream other than the last join's, its slot
// is marked and its event recorded on it. Hot path: one relaxed load when
// hooks run on the training stream.
void seal_ring_write(int device, cudaStream_t s) {
  if (device < 0 || device >= kMaxDevices || is_side_stream(device, s)) return;  // joined by its own event
  WriteStreams& w = g_write_streams[device];
  const uintptr_t key = reinterpret_cast<uintptr_t>(s) + 1;
  if (w.step_stream.load(std::memory_order_relaxed) == key || capturing(s)) return;
  int slot = -1;
  for (int i = 0; i < kMaxWriteStreams && slot < 0; ++i) {
    uintptr_t cur = w.keys[i].load(std::memory_order_relaxed);
    if (cur == key || (cur == 0 && (w.keys[i].compare_exchange_strong(cur, key) || cur == key))) slot = i;
  }
  if (slot < 0) {
    w.overflow.store(true, std::memory_order_relaxed);
    return;
  }
  const cudaError_t err = cudaEventRecord(write_event(w, slot), s);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // ours: this call's
    TORCH_WARN_ONCE("hookcap: could not mark telemetry written on a side stream: ", cudaGetErrorString(err));
  }
}

// How a launch's blocks merge their partials (block_merge): 0, each block
// into the ring with its own atomics (the default: the shorter tail on an
// H100/H200 as measured by benchmarks/gpu_check.py); 1, the tree
// (launch_plan.cuh), fewer atomics for a longer serial tail.
std::atomic<int> g_block_merge{0};

// Scratch of the accumulate kernels' tree merge (launch_plan.cuh), one per
// stream that launches them: launches on one stream run one after another,
// so they can share it (each leaves its tickets at 0). Created zeroed, on
// that stream, at its first launch there (max_blocks' records) and kept for
// the process (a few hundred KB per stream; torch's streams are pooled). A
// launch captured into a CUDA graph, or beyond kMaxScratchStreams streams,
// gets none: its blocks merge into the ring directly, since a replay may
// run beside any eager launch.
constexpr int kMaxScratchStreams = 64;
struct ScratchSlot {
  std::atomic<uintptr_t> key;  // stream handle + 1, 0 = free
  std::atomic<int64_t*> words;
};
ScratchSlot g_scratch[kMaxDevices][kMaxScratchStreams];
std::mutex g_scratch_mu;
std::vector<at::Tensor>* g_scratch_keep = new std::vector<at::Tensor>();  // never freed: outlives exit

int64_t* tree_scratch(const at::Device& device, cudaStream_t s, int64_t blocks) {
  const int d = device.index();
  if (g_block_merge.load(std::memory_order_relaxed) == 0) return nullptr;
  if (blocks < 2 || d < 0 || d >= kMaxDevices || capturing(s)) return nullptr;
  const uintptr_t key = reinterpret_cast<uintptr_t>(s) + 1;
  ScratchSlot* slots = g_scratch[d];
  for (int i = 0; i < kMaxScratchStreams; ++i) {  // hot path: found at once, two loads
    const uintptr_t k = slots[i].key.load(std::memory_order_acquire);
    if (k == key) return slots[i].words.load(std::memory_order_acquire);
    if (k == 0) break;
  }
  std::lock_guard<std::mutex> lk(g_scratch_mu);
  for (int i = 0; i < kMaxScratchStreams; ++i) {
    const uintptr_t k = slots[i].key.load(std::memory_order_relaxed);
    if (k == key) return slots[i].words.load(std::memory_order_relaxed);
    if (k != 0) continue;
    // Allocated and zeroed on s, which orders it before the launch.
    std::optional<c10::cuda::CUDAStreamGuard> on_side;
    if (is_side_stream(d, s)) on_side.emplace(side_stream(d));
    at::Tensor t = at::zeros({kernels::tree_scratch_words(max_blocks(d))},
                             at::TensorOptions().dtype(at::kLong).device(device));
    g_scratch_keep->push_back(t);
    slots[i].words.store(t.data_ptr<int64_t>(), std::memory_order_relaxed);
    slots[i].key.store(key, std::memory_order_release);
    return t.data_ptr<int64_t>();
  }
  return nullptr;
}

}  // namespace

uintptr_t side_stream_handle(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices && device < c10::cuda::device_count(),
              "hookcap: no CUDA device ", device);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return reinterpret_cast<uintptr_t>(side_stream(device).stream());
}

int block_merge(int mode) {
  return mode < 0 ? g_block_merge.load() : g_block_merge.exchange(mode != 0 ? 1 : 0);
}

bool captured_ring(uintptr_t ring) {
  std::lock_guard<std::mutex> lk(g_captured_mu);
  return captured_locked(ring);
}

int64_t join_write_streams(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  // Inside a capture the graph's own edges order its streams (and waiting
  // on an event recorded outside it is not allowed): join after it.
  if (capturing(cur)) return 0;
  WriteStreams& w = g_write_streams[device];
  const uintptr_t cur_key = reinterpret_cast<uintptr_t>(cur) + 1;
  int64_t joined = 0;
  auto wait = [&](cudaEvent_t ev) {
    const cudaError_t err = cudaStreamWaitEvent(cur, ev, 0);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // ours: this call's
      TORCH_WARN_ONCE("hookcap: could not order the drain after a stream that wrote telemetry: ",
                      cudaGetErrorString(err));
      return;
    }
    ++joined;
  };
  // Writes on the last join's stream were not marked: if this step() runs on
  // another stream, that one (the previous training stream) is joined here.
  const uintptr_t prev = w.step_stream.exchange(cur_key);
  if (prev != 0 && prev != cur_key) {
    if (w.step_event == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&w.step_event, cudaEventDisableTiming));
    const auto ps = reinterpret_cast<cudaStream_t>(prev - 1);
    if (!capturing(ps)) {
      const cudaError_t err = cudaEventRecord(w.step_event, ps);
      if (err == cudaSuccess) {
        wait(w.step_event);
      } else {
        (void)cudaGetLastError();
        TORCH_WARN_ONCE("hookcap: could not order the drain after the previous step's stream: ",
                        cudaGetErrorString(err));
      }
    }
  }
  if (g_side.used[device].exchange(false, std::memory_order_acq_rel)) {
    if (w.side_event == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&w.side_event, cudaEventDisableTiming));
    const cudaError_t err = cudaEventRecord(w.side_event, side_stream(device).stream());
    if (err == cudaSuccess) {
      wait(w.side_event);
    } else {
      (void)cudaGetLastError();
      TORCH_WARN_ONCE("hookcap: could not order the drain after the side stream: ", cudaGetErrorString(err));
    }
  }
  for (int i = 0; i < kMaxWriteStreams; ++i) {
    const uintptr_t key = w.keys[i].exchange(0);
    if (key == 0 || key == cur_key) continue;  // the current stream orders itself
    const cudaEvent_t ev = w.events[i].load(std::memory_order_acquire);
    if (ev != nullptr) wait(ev);
  }
  if (w.overflow.exchange(false)) {
    TORCH_WARN_ONCE("hookcap: hooks ran on more than ", kMaxWriteStreams,
                    " CUDA streams in one step; the drain waits for the first ", kMaxWriteStreams,
                    " only");
  }
  return joined;
}

namespace {

// Launch through cudaLaunchKernel, which returns this launch's own error: a
// failed launch is reported (and only its error cleared), while an error
// another library left pending stays for its owner. The usual check
// (cudaGetLastError after <<<>>>) would clear, or report as ours, theirs.
// launch_smem: with `shared_bytes` of dynamic shared memory.
template <typename... P, typename... A>
void launch_smem(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes,
                 cudaStream_t stream, A&&... args) {
  std::tuple<std::decay_t<P>...> vals(std::forward<A>(args)...);
  const cudaError_t err = std::apply(
      [&](auto&... v) {
        void* ptrs[] = {static_cast<void*>(&v)...};
        return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, ptrs,
                                shared_bytes, stream);
      },
      vals);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // ours: this launch's
    TORCH_CHECK(false, "hookcap: launching ", what, " failed: ", cudaGetErrorString(err));
  }
}

template <typename... P, typename... A>
void launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream,
            A&&... args) {
  launch_smem(what, kernel, grid, block, 0, stream, std::forward<A>(args)...);
}

// Dynamic shared memory an accumulate block may take on a device so that
// kernels::kMinBlocks blocks of kThreads still fit per SM (kernels::smem_budget;
// H100: 56,496 bytes, A100: 40,112), cached per device (host-only queries).
int64_t smem_budget(int device) {
  static std::atomic<int64_t> budget[kMaxDevices] = {};  // as max_blocks
  if (device < 0 || device >= kMaxDevices) return 0;
  int64_t b = budget[device].load(std::memory_order_relaxed);
  if (b == 0) {
    int per_sm = 0, reserved = 0, optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    b = std::max<int64_t>(kernels::smem_budget(per_sm, reserved, optin), 1);
    budget[device].store(b, std::memory_order_relaxed);
  }
  return b;
}

// Let `kernel` take `bytes` of dynamic shared memory on `device` (the current
// one): past 48 KB a kernel must opt in. Set once per kernel and device, to
// the device's whole budget; host-only, no sync.
void allow_dynamic_smem(const void* kernel, int device, int64_t bytes) {
  if (bytes + kernels::kStaticSmem <= 48 * 1024) return;
  struct Allowed {
    const void* kernel;
    int device;
    int64_t bytes;
  };
  static std::mutex mu;
  static std::vector<Allowed> allowed;
  std::lock_guard<std::mutex> lk(mu);
  for (const Allowed& a : allowed) {
    if (a.kernel == kernel && a.device == device && a.bytes >= bytes) return;
  }
  const int64_t want = std::max(bytes, smem_budget(device));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(want)));
  allowed.push_back({kernel, device, want});
}

// The statistics kernel over x_in into `row`, on `stream` (stats_stream's,
// under the caller's guard for x_in's device); with groups > 1, in the same
// launch (grid rows), group g's view at x_in + g * x_step into row + g *
// row_step, x_in being group 0's view (each group's view alike).
void launch_accumulate(const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state, int64_t row,
                       const HistSpec& h, cudaStream_t stream, int64_t groups = 1, int64_t row_step = 0,
                       int64_t x_step = 0) {
  const int64_t n = x_in.numel();
  note_capture(stream, ring.data_ptr());

  const DimPlan plan = plan_read(x_in);
  // Each thread streams >= kPerThread elements of a large tensor (loads in
  // flight, start-up amortised); small tensors use few blocks. Empty tensors
  // still launch one block so count/calls are recorded on the device (the
  // host never reads the enabled flag).
  const int device = x_in.device().index();
  auto blocks_for = [&](int64_t visit) {
    return blocks_for_elements(visit, kThreads * kPerThread, std::max<int64_t>(1, max_blocks(device) / groups));
  };
  const int64_t blocks = blocks_for(plan.visit);
  // The tree merge's tickets serve one row per launch.
  int64_t* scratch = groups == 1 ? tree_scratch(x_in.device(), stream, blocks) : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND4(
      at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2, x_in.scalar_type(),
      "hookcap_accumulate_cuda", [&] {
        const scalar_t* p = x_in.const_data_ptr<scalar_t>();
        StridedDesc vec;
        RowTails tails;
        const ReadKind read = kernels::accumulate_read(
            vector_read(plan, sizeof(scalar_t), reinterpret_cast<uintptr_t>(p), vec, tails), h);
        for_each_pass(plan, read, vec, tails, [&](ReadKind kind, const StridedDesc& desc, int64_t skip,
                                                  int64_t visit, bool counts) {
          const int64_t nblocks = counts ? blocks : blocks_for(visit);
          kernels::dispatch_accumulate<scalar_t>(
              kind, h, smem_budget(device), [&](auto kernel, const kernels::HistPlan& hp) {
                allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device,
                                   hp.smem + kernels::static_smem_extra(h));
                for_each_read(plan, [&](int64_t offset, bool first) {
                  const bool once = counts && first;  // the view's count and call, once
                  const kernels::RowTarget tgt{ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(),
                                               row, ring.size(1), ring.size(2), ring.size(0),
                                               once ? n : 0, once ? 1 : 0, plan.mult,
                                               nblocks >= 2 ? scratch : nullptr, row_step, x_step};
                  launch_smem("hookcap.accumulate", kernel,
                              dim3(static_cast<unsigned>(nblocks), static_cast<unsigned>(groups)),
                              dim3(kThreads), static_cast<size_t>(hp.smem), stream, p + offset + skip, visit, desc,
                              tgt, h, hp.lin, kernels::ManyArg<false>{});
                });
              });
        });
      });
  seal_ring_write(device, stream);
}

// One tensor's launch, on the stream `side` picks.
void accumulate_one(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, int64_t row, const HistSpec& h,
                    bool side) {
  c10::cuda::CUDAGuard guard(x.device());
  launch_accumulate(x, ring, state, row, h, stats_stream(x.device().index(), side, {&x, &ring, &state}));
}

void accumulate_cuda(const at::Tensor& x_in, at::Tensor& ring, const at::Tensor& state,
                     int64_t row, int64_t hist_kind, double hist_lo, double hist_hi,
                     int64_t hist_bins) {
  check_accumulate(x_in, ring, state, row);
  accumulate_one(x_in, ring, state, row, make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2)),
                 on_side_stream(hist_kind));
}

// accumulate_many: many_plan.h's launches.
void accumulate_many_cuda(at::TensorList xs, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                          int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_many(xs, ring, state, rows);
  if (xs.empty()) return;
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  c10::cuda::CUDAGuard guard(ring.device());
  const int device = ring.device().index();
  cudaStream_t stream = stats_stream(device, on_side_stream(hist_kind), [&](auto&& keep) {
    keep(ring);
    keep(state);
    for (const at::Tensor& x : xs) keep(x);
  });
  note_capture(stream, ring.data_ptr());
  plan_many(
      xs, rows, kThreads * kPerThread, max_blocks(device),
      [&](size_t i) { launch_accumulate(xs[i], ring, state, rows[i], h, stream); },
      [&](const ManyBatch& b) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, b.dtype, "hookcap_accumulate_many_cuda", [&] {
          kernels::dispatch_accumulate<scalar_t, true>(
              kReadFlat, h, smem_budget(device), [&](auto kernel, const kernels::HistPlan& hp) {
                allow_dynamic_smem(reinterpret_cast<const void*>(kernel), device,
                                   hp.smem + kernels::static_smem_extra(h));
                launch_smem("hookcap.accumulate_many", kernel,
                            dim3(static_cast<unsigned>(b.blocks), static_cast<unsigned>(b.tensors)),
                            dim3(kThreads), static_cast<size_t>(hp.smem), stream,
                            static_cast<const scalar_t*>(nullptr), int64_t{0}, StridedDesc{}, many_target(ring, state),
                            h, hp.lin, kernels::ManyArg<true>{b.table});
              });
        });
      });
  seal_ring_write(device, stream);
}

// accumulate_updates: check_updates, then one launch per run of up to
// kernels::kUpdateTensors parameters (update_plan.h).
void accumulate_updates_cuda(at::TensorList params, const c10::List<c10::optional<at::Tensor>>& grads,
                             const c10::List<c10::optional<at::Tensor>>& a,
                             const c10::List<c10::optional<at::Tensor>>& b,
                             const c10::List<c10::optional<at::Tensor>>& steps, c10::ArrayRef<double> hyper,
                             int64_t rule, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                             int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_updates(params, grads, a, b, steps, hyper, rule, ring, state, rows);
  if (params.empty()) return;
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  c10::cuda::CUDAGuard guard(ring.device());
  const int device = ring.device().index();
  cudaStream_t stream = stats_stream(device, on_side_stream(hist_kind), [&](auto&& keep) {
    keep(ring);
    keep(state);
    for (const at::Tensor& p : params) keep(p);
    for (const auto* list : {&grads, &a, &b, &steps}) {
      for (size_t i = 0; i < list->size(); ++i) {
        const c10::optional<at::Tensor> t = list->get(i);
        if (t.has_value()) keep(*t);
      }
    }
  });
  note_capture(stream, ring.data_ptr());
  // A step count on the device (capturable / fused Adam) is read by the kernel: no sync.
  auto device_step = [](const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined() && !t->is_cpu(); };
  plan_updates(params, grads, a, b, steps, hyper, rule, rows, h, kThreads * kPerThread, max_blocks(device),
               device_step, [&](auto kernel, const auto& batch, const UpdateRule& r, const kernels::UpdateOuts& o,
                                int32_t blocks, int64_t smem) {
                 launch_smem("hookcap.accumulate_update", kernel, dim3(blocks), dim3(kThreads),
                             static_cast<size_t>(smem), stream, batch, r, ring.data_ptr<int64_t>(),
                             state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1), ring.size(2), o, h);
               });
  seal_ring_write(device, stream);
}

void accumulate_update_cuda(const at::Tensor& param, const c10::optional<at::Tensor>& grad,
                            const c10::optional<at::Tensor>& a, const c10::optional<at::Tensor>& b,
                            const c10::optional<at::Tensor>& step, c10::ArrayRef<double> hyper,
                            int64_t rule, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                            int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  accumulate_updates_cuda({param}, c10::List<c10::optional<at::Tensor>>({grad}),
                          c10::List<c10::optional<at::Tensor>>({a}), c10::List<c10::optional<at::Tensor>>({b}),
                          c10::List<c10::optional<at::Tensor>>({step}), hyper, rule, ring, state, rows, hist_kind,
                          hist_lo, hist_hi, hist_bins);
}

// Blocks of kThreads for a reset of `words` ring words: one word per thread
// up to 1,024 blocks (a slot of thousands of metrics), then a grid-stride loop.
int64_t reset_blocks(int64_t words) {
  return std::max<int64_t>(1, std::min<int64_t>((words + kThreads - 1) / kThreads, 1024));
}

void launch_reset_rows(at::Tensor& ring, const at::Tensor& state, int64_t begin, int64_t end) {
  if (begin == end) return;
  c10::cuda::CUDAGuard guard(ring.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ring.device().index()).stream();
  const int64_t blocks = reset_blocks((end - begin) * ring.size(2));
  launch("hookcap.reset_rows", &kernels::reset_rows_kernel, dim3(blocks), dim3(kThreads), stream,
         ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1),
         ring.size(2), begin, end);
}

void reset_slot_cuda(at::Tensor& ring, const at::Tensor& state) {
  check_ring_state(ring, state);
  launch_reset_rows(ring, state, 0, ring.size(1));
}

void reset_rows_cuda(at::Tensor& ring, const at::Tensor& state, int64_t begin, int64_t end) {
  check_reset_rows(ring, state, begin, end);
  launch_reset_rows(ring, state, begin, end);
}

void advance_cuda(at::Tensor& ring, at::Tensor& state, int64_t every) {
  check_ring_state(ring, state);
  TORCH_CHECK(every >= 1, "hookcap.advance: every must be >= 1, got ", every);
  c10::cuda::CUDAGuard guard(ring.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ring.device().index()).stream();
  // Two launches: every block of the reset reads the state before it moves.
  launch("hookcap.advance", &kernels::advance_reset_kernel,
         dim3(reset_blocks(ring.size(1) * ring.size(2))), dim3(kThreads), stream,
         ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1),
         ring.size(2), every);
  launch("hookcap.advance", &kernels::advance_state_kernel, dim3(1), dim3(1), stream,
         state.data_ptr<int64_t>(), ring.size(0), every);
}

// Device clock, stream-ordered: %globaltimer (ns) read by one thread when the
// stream reaches the mark, so the host neither waits nor reads it. Kept out of
// stats_kernel.cuh because the CPU emulation harness has no device clock.
__global__ void time_mark_kernel(int64_t* ring, const int64_t* state, int64_t slots,
                                 int64_t rows, int64_t width, int64_t row, int64_t phase,
                                 bool start) {
  if (state[kStateEnabled] == 0) return;
  const int64_t slot = state[kStateSlot];
  if (slot < 0 || slot >= slots) return;  // same guard as the stats kernels
  const auto now = static_cast<int64_t>(cuda::ptx::get_sreg_globaltimer());
  row_time_mark<kernels::DeviceAtomics>(ring + (slot * rows + row) * width, phase, start, now);
}

void time_mark_cuda(at::Tensor& ring, const at::Tensor& state, int64_t row, int64_t phase,
                    bool start) {
  check_time_mark(ring, state, row, phase);
  c10::cuda::CUDAGuard guard(ring.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(ring.device().index()).stream();
  note_capture(stream, ring.data_ptr());
  launch("hookcap.time_mark", &time_mark_kernel, dim3(1), dim3(1), stream, ring.data_ptr<int64_t>(),
         state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1), ring.size(2), row, phase, start);
  seal_ring_write(ring.device().index(), stream);
}

// accumulate_groups: one launch of the statistics kernel for every group
// (grid rows, group_launch), on the current stream; else one per group's view.
// Neither copies.
void accumulate_groups_cuda(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, c10::IntArrayRef rows,
                            int64_t dim, int64_t size, int64_t hist_kind, double hist_lo, double hist_hi,
                            int64_t hist_bins) {
  check_groups(x, ring, state, rows, dim, size);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = stats_stream(x.device().index(), on_side_stream(hist_kind), {&x, &ring, &state});
  const GroupLaunch one = group_launch(x, rows, dim, size);
  if (one.ok) {
    launch_accumulate(x.narrow(dim, 0, size), ring, state, rows[0], h, stream, one.groups, one.row_step, one.x_step);
    return;
  }
  for (int64_t g = 0; g < static_cast<int64_t>(rows.size()); ++g) {
    if (rows[g] >= 0) launch_accumulate(x.narrow(dim, g * size, size), ring, state, rows[g], h, stream);
  }
}

// accumulate_bins: a launch per kBinsPerLaunch bins (their rows travel in
// the arguments), grid.y one bin each, on the current stream.
void accumulate_bins_cuda(const at::Tensor& index, const c10::optional<at::Tensor>& weight, at::Tensor& ring,
                          const at::Tensor& state, c10::IntArrayRef rows, int64_t hist_kind, double hist_lo,
                          double hist_hi, int64_t hist_bins) {
  check_bins(index, weight, ring, state, rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  c10::cuda::CUDAGuard guard(ring.device());
  const int device = ring.device().index();
  const at::Tensor no_weight;
  cudaStream_t stream = stats_stream(device, on_side_stream(hist_kind),
                                     {&index, weight.has_value() ? &*weight : &no_weight, &ring, &state});
  note_capture(stream, ring.data_ptr());
  const int64_t n = index.numel(), bins = static_cast<int64_t>(rows.size());
  const int64_t blocks = std::clamp<int64_t>((n + kThreads * kPerThread - 1) / (kThreads * kPerThread), 1, 64);
  const int64_t smem = kernels::bins_smem_bytes(h.kind == kHistNone ? 0 : h.nbins);
  const bool weighted = weight.has_value() && weight->defined();
  auto run = [&](auto* w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    AT_DISPATCH_INTEGRAL_TYPES(index.scalar_type(), "hookcap_bins_cuda", [&] {
      kernels::for_bins_launch(rows.data(), bins, [&](const kernels::BinsRows& r, int64_t b0, int64_t nb) {
        launch_smem("hookcap.accumulate_bins", &kernels::bins_kernel<scalar_t, W>,
                    dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(nb)), dim3(kThreads),
                    static_cast<size_t>(smem), stream, index.const_data_ptr<scalar_t>(), w, n, r, b0, bins,
                    ring.data_ptr<int64_t>(), state.const_data_ptr<int64_t>(), ring.size(0), ring.size(1),
                    ring.size(2), h);
      });
    });
  };
  if (!weighted) {
    run(static_cast<const float*>(nullptr));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight->scalar_type(), "hookcap_bins_cuda_w", [&] {
      run(weight->const_data_ptr<scalar_t>());
    });
  }
  seal_ring_write(device, stream);
}

// On the current stream (the tile was just written there; its outputs are
// read there).
std::tuple<at::Tensor, at::Tensor> attention_rows_cuda(at::Tensor& logits, int64_t causal_row0) {
  c10::cuda::CUDAGuard guard(logits.device());
  AttentionRows a = attention_rows_outputs(logits, causal_row0);
  if (a.rows == 0) return {a.lse, a.entropy};
  const int64_t blocks = (a.rows + kAttnRowsPerBlock - 1) / kAttnRowsPerBlock;
  TORCH_CHECK(blocks <= INT32_MAX, "hookcap: attention_rows: ", a.rows, " rows are too many for one launch");
  launch("hookcap.attention_rows", &kernels::attention_rows_kernel, dim3(static_cast<unsigned>(blocks)),
         dim3(kThreads), c10::cuda::getCurrentCUDAStream(logits.device().index()).stream(),
         logits.data_ptr<float>(), a.rows, a.tile_rows, a.keys, causal_row0, a.lse.data_ptr<float>(),
         a.entropy.data_ptr<float>());
  return {a.lse, a.entropy};
}

// attention_rows, then the statistics of each head's logits, lse and
// entropy as accumulate_groups along the heads: four launches from one call.
void accumulate_attention_cuda(at::Tensor& logits, int64_t causal_row0, at::Tensor& ring, const at::Tensor& state,
                               c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows, c10::IntArrayRef entropy_rows,
                               int64_t hist_kind, double hist_lo, double hist_hi, int64_t hist_bins) {
  check_attention_record(logits, causal_row0, ring, state, logit_rows, lse_rows, entropy_rows);
  auto [lse, entropy] = attention_rows_cuda(logits, causal_row0);
  accumulate_groups_cuda(logits, ring, state, logit_rows, 1, 1, hist_kind, hist_lo, hist_hi, hist_bins);
  accumulate_groups_cuda(lse, ring, state, lse_rows, 1, 1, hist_kind, hist_lo, hist_hi, hist_bins);
  accumulate_groups_cuda(entropy, ring, state, entropy_rows, 1, 1, hist_kind, hist_lo, hist_hi, hist_bins);
}

// Whether `device` runs attention_qk_kernel (tensor cores with bfloat16
// and float16 operands: sm_80 on), cached per device.
bool qk_device_ok(int device) {
  static std::atomic<int> ok[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= kMaxDevices) return false;
  int v = ok[device].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    v = major >= 8 ? 2 : 1;
    ok[device].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

// attention_qk: one launch of attention_qk_kernel (the logits' statistics
// per head, each row's logsumexp and entropy, no logits in memory), then the
// rows' logsumexp and entropy as accumulate_groups along the heads: three
// launches for the whole call, on the current stream.
void attention_qk_cuda(const at::Tensor& q, const at::Tensor& k, bool causal, double scale, at::Tensor& ring,
                       const at::Tensor& state, c10::IntArrayRef logit_rows, c10::IntArrayRef lse_rows,
                       c10::IntArrayRef entropy_rows, int64_t hist_kind, double hist_lo, double hist_hi,
                       int64_t hist_bins) {
  check_attention_qk(q, k, ring, state, logit_rows, lse_rows, entropy_rows);
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring.size(2));
  c10::cuda::CUDAGuard guard(q.device());
  const int device = q.device().index();
  const char* why = attention_qk_unsupported(q, k, h, smem_budget(device));
  TORCH_CHECK(why == nullptr && qk_device_ok(device), "hookcap.attention_qk: not for these inputs (",
              why ? why : "the GPU needs compute capability 8.0 or later", ")");
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  note_capture(stream, ring.data_ptr());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor entropy = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  const kernels::QkArgs a = attention_qk_args(q, k, causal, scale, lse, entropy);
  const QkLaunch l = attention_qk_launch(q, k, ring, state, h, smem_budget(device));
  // Its static shared memory: the exponent tables and the block's partials.
  allow_dynamic_smem(reinterpret_cast<const void*>(l.kernel), device,
                     l.smem + static_cast<int64_t>(sizeof(kernels::Log2ExpSmem)));
  launch_smem("hookcap.attention_qk", l.kernel, dim3(l.blocks_x, l.blocks_y), dim3(kThreads),
              static_cast<size_t>(l.smem), stream, a, attention_qk_rows(logit_rows), l.tgt, h);
  seal_ring_write(device, stream);
  accumulate_groups_cuda(lse, ring, state, lse_rows, 1, 1, hist_kind, hist_lo, hist_hi, hist_bins);
  accumulate_groups_cuda(entropy, ring, state, entropy_rows, 1, 1, hist_kind, hist_lo, hist_hi, hist_bins);
}

}  // namespace

void accumulate_row_cuda(const at::Tensor& x, at::Tensor& ring, const at::Tensor& state, int64_t row,
                         const HistSpec& h, bool side) {
  accumulate_one(x, ring, state, row, h, side);
}

bool attention_qk_supported_cuda(const at::Tensor& q, const at::Tensor& k, int64_t hist_kind, double hist_lo,
                                 double hist_hi, int64_t hist_bins, int64_t ring_width) {
  if (!q.is_cuda() || !k.is_cuda()) return false;
  const HistSpec h = make_hist_spec(hist_kind, hist_lo, hist_hi, hist_bins, ring_width);
  const int device = q.device().index();
  return qk_device_ok(device) && attention_qk_unsupported(q, k, h, smem_budget(device)) == nullptr;
}

TORCH_LIBRARY_IMPL(hookcap, CUDA, m) {
  m.impl("accumulate_bins", &accumulate_bins_cuda);
  m.impl("accumulate", &accumulate_cuda);
  m.impl("accumulate_many", &accumulate_many_cuda);
  m.impl("accumulate_groups", &accumulate_groups_cuda);
  m.impl("accumulate_update", &accumulate_update_cuda);
  m.impl("accumulate_updates", &accumulate_updates_cuda);
  m.impl("attention_rows", &attention_rows_cuda);
  m.impl("accumulate_attention", &accumulate_attention_cuda);
  m.impl("attention_qk", &attention_qk_cuda);
  m.impl("reset_slot", &reset_slot_cuda);
  m.impl("reset_rows", &reset_rows_cuda);
  m.impl("advance", &advance_cuda);
  m.impl("time_mark", &time_mark_cuda);
}

}  // namespace hookcap
