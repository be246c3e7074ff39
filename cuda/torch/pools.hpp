// pools.hpp: PyTorch's private memory pools under pyalloc.
//
// Note [Private pools under PyTorch]
// PyTorch names a private pool by a MempoolId_t, a pair of integers: a CUDA
// graph's capture makes one ({n, 0}) unless it is given one to share
// (torch.cuda.graph_pool_handle(), another graph's pool(), a MemPool's id:
// {0, n}), and each torch.cuda.MemPool makes one. Its allocator is told:
//   createOrIncrefPool(device, id)       a MemPool was made: use count + 1;
//   beginAllocateToPool(device, id, f)   from now on, allocations on `device`
//                                        for which f(stream) is true go to
//                                        the pool (f tests the stream's
//                                        capture id for a graph, the calling
//                                        thread for use_mem_pool): + 1;
//   endAllocateToPool(device, id)        stop routing to it;
//   releasePool(device, id)              - 1 (a graph was reset, use_mem_pool
//                                        left, a MemPool destroyed);
//   markCaptureBegin/End(device)         the capture itself began / ended.
// Each (device, id) gets a user pool of pyalloc, held while its use count is
// above zero (Note [Held pools] in allocator/src/device/pools.cpp): its memory
// stays where the graph's kernels saw it. At zero the pool is let go and its
// free memory released; once it holds nothing at all, its pyalloc pool is
// reused for the next private pool, and past 1024 pools made, one let go
// with live blocks too (pyalloc keeps at most 4096 pools per process, and a
// program may make graphs without end). While allocations are routed to a
// pool, its device is in capture mode (pyalloc_capture_begin/end, Note
// [Capture]), as PyTorch's own allocator treats every route.
//
// c10 only (no CUDA header): a stream is a void*, and the tests drive these
// through torch.ops.pyalloc on a CPU build of PyTorch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

namespace pyalloc::torch_layer {

using PoolKey = std::pair<unsigned long long, unsigned long long>;  // c10::cuda::MempoolId_t
using StreamFilter = std::function<bool(void*)>;

class Pools {
 public:
  static Pools& instance();

  void incref(int device, PoolKey key);  // createOrIncrefPool
  void release(int device, PoolKey key);  // releasePool
  int use_count(int device, PoolKey key);  // 0 for a pool never made
  void begin_route(int device, PoolKey key, StreamFilter filter);  // beginAllocateToPool
  void end_route(int device, PoolKey key);  // endAllocateToPool
  void set_use_on_oom(int device, PoolKey key, bool on);

  // The pyalloc pool an allocation on (device, stream) goes to; 0 (the default
  // pools) when no route takes it. One relaxed load when nothing is routed.
  int route(int device, void* stream) {
    if (routes_.load(std::memory_order_relaxed) == 0) return 0;
    return route_slow(device, stream);
  }
  // The pools a failed default-pool request of `device` may fall back to
  // (torch.cuda.MemPool(use_on_oom=True)).
  std::vector<int> oom_fallbacks(int device);

  // emptyCache(id): the wholly free memory of every device's pool `key`.
  size_t empty(PoolKey key);
  // The PyTorch id of pyalloc pool `pool` ({0, 0} for the default pools),
  // for snapshots; and whether the allocated blocks of (device, key) are
  // exactly `expected` (checkPoolLiveAllocations).
  PoolKey key_of(int pool);
  bool live_allocations_are(int device, PoolKey key, const std::unordered_set<void*>& expected);

  // markCaptureBegin/End. The device's capture mode spans the route
  // (begin_route to end_route: PyTorch's own allocator treats a route so,
  // and a graph reset after a failed capture ends the route but marks no
  // end); the marks only count.
  void capture_begin(int device);
  void capture_end(int device);
  // Whether a route or a capture mark is open anywhere: the torch-facing
  // allocator then asks for memory in CUDA's relaxed capture mode.
  bool capturing() const {
    return routes_.load(std::memory_order_relaxed) > 0 || marks_.load(std::memory_order_relaxed) > 0;
  }

 private:
  struct Entry {
    int pool;  // pyalloc's
    int uses;
    bool use_on_oom;
  };
  struct Route {
    int device;
    PoolKey key;
    int pool;
    StreamFilter filter;
  };
  using EntryKey = std::pair<int, PoolKey>;  // (device, id)

  int route_slow(int device, void* stream);
  Entry& entry_locked(int device, PoolKey key);  // made (held, 0 uses) if new
  int new_pool_locked();
  void let_go_locked(int pool);

  std::mutex mutex_;
  std::map<EntryKey, Entry> entries_;
  std::map<int, PoolKey> keys_;     // pyalloc pool -> PyTorch id, while in use
  std::vector<int> draining_;       // let go, still holding live blocks
  std::vector<int> spare_;          // let go and empty: reused first
  std::vector<Route> route_list_;
  std::atomic<int> routes_{0};
  std::atomic<int> marks_{0};
  int made_ = 0;
  static constexpr int kMadeBeforeReuse = 1024;  // pools made before one let go with live blocks is reused
};

}  // namespace pyalloc::torch_layer
