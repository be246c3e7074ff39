// pools.cpp: Note [Private pools under PyTorch] (pools.hpp).
#include "pools.hpp"

#include <pyalloc/pyalloc.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace pyalloc::torch_layer {

namespace {

std::string describe(PoolKey key) {
  return "(" + std::to_string(key.first) + ", " + std::to_string(key.second) + ")";
}

void check_ok(int status, const char* what) {
  if (status == PYALLOC_OK) return;
  const char* last = pyalloc_last_error();
  TORCH_CHECK(false, "pyalloc: ", what, ": ", last != nullptr ? last : "failed");
}

// The live blocks of one pyalloc pool on one device, by a snapshot walk.
struct LiveWalk {
  int pool;
  bool in_pool = false;
  std::unordered_set<void*> live;
};

void walk_segment(const pyalloc_segment_info_t* s, void* user) {
  auto* w = static_cast<LiveWalk*>(user);
  w->in_pool = s->pool_id == w->pool;
}

void walk_block(const pyalloc_block_info_t* b, void* user) {
  auto* w = static_cast<LiveWalk*>(user);
  if (w->in_pool && b->allocated) w->live.insert(reinterpret_cast<void*>(b->address));
}

}  // namespace

Pools& Pools::instance() {
  static Pools* pools = new Pools;  // leaked: frees may come during exit
  return *pools;
}

// ---- use counts ------------------------------------------------------------------------

int Pools::new_pool_locked() {
  // One pool let go is looked at per call (no walk of them all): if it has
  // emptied since, it is as good as new.
  if (!draining_.empty()) {
    size_t released = 0;
    size_t still = 0;
    if (pyalloc_pool_empty_cache(draining_.front(), &released, &still) == PYALLOC_OK && still == 0) {
      spare_.push_back(draining_.front());
      draining_.erase(draining_.begin());
    }
  }
  int pool = 0;
  if (!spare_.empty()) {
    pool = spare_.back();
    spare_.pop_back();
  } else if (made_ >= kMadeBeforeReuse && !draining_.empty()) {
    // Past this many, a pool let go with live blocks (a dead graph's outputs)
    // serves the new one: its blocks come back to it when freed, which costs
    // nothing but their attribution (pyalloc keeps at most 4096 pools).
    pool = draining_.front();
    draining_.erase(draining_.begin());
  } else {
    const std::string name = "torch-private-" + std::to_string(++made_);
    check_ok(pyalloc_pool_create(name.c_str(), &pool), "making a private pool");
  }
  check_ok(pyalloc_pool_hold(pool, 1), "holding a private pool");
  return pool;
}

Pools::Entry& Pools::entry_locked(int device, PoolKey key) {
  const EntryKey k{device, key};
  auto it = entries_.find(k);
  if (it == entries_.end()) {
    const int pool = new_pool_locked();
    it = entries_.emplace(k, Entry{pool, 0, false}).first;
    keys_[pool] = key;
  }
  return it->second;
}

void Pools::let_go_locked(int pool) {
  // Reached from releasePool, which destructors call (~MemPool, a graph's
  // reset): a failure warns, it never throws.
  size_t released = 0;
  size_t still = 0;
  if (pyalloc_pool_hold(pool, 0) != PYALLOC_OK ||
      pyalloc_pool_empty_cache(pool, &released, &still) != PYALLOC_OK) {
    const char* last = pyalloc_last_error();
    TORCH_WARN("pyalloc: letting private pool ", pool, " go failed: ", last != nullptr ? last : "unknown error");
    return;
  }
  (still == 0 ? spare_ : draining_).push_back(pool);
}

void Pools::incref(int device, PoolKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++entry_locked(device, key).uses;
}

void Pools::release(int device, PoolKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Called from destructors (a MemPool's, a CUDAGraph's reset): it warns
  // rather than throws.
  const auto it = entries_.find({device, key});
  if (it == entries_.end()) {
    TORCH_WARN("pyalloc: releasePool of private pool ", describe(key), " on device ", device,
               ", which was never made or is already released");
    return;
  }
  if (--it->second.uses > 0) return;
  const bool routed = std::any_of(route_list_.begin(), route_list_.end(),
                                  [&](const Route& r) { return r.device == device && r.key == key; });
  if (routed) {  // allocations still go to it: it stays held until end_route
    TORCH_WARN("pyalloc: private pool ", describe(key), " released while allocations are still routed to it");
    it->second.uses = 0;
    return;
  }
  const int pool = it->second.pool;
  entries_.erase(it);
  let_go_locked(pool);
}

int Pools::use_count(int device, PoolKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find({device, key});
  return it == entries_.end() ? 0 : it->second.uses;
}

void Pools::set_use_on_oom(int device, PoolKey key, bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = entries_.find({device, key});
  if (it == entries_.end()) {
    TORCH_CHECK(!on, "pyalloc: setUseOnOOM of private pool ", describe(key), " on device ", device,
                ", which was never made");
    return;  // MemPool's destructor turns it off on a pool that is gone
  }
  it->second.use_on_oom = on;
}

// ---- routing ---------------------------------------------------------------------------

void Pools::begin_route(int device, PoolKey key, StreamFilter filter) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(std::none_of(route_list_.begin(), route_list_.end(),
                           [&](const Route& r) { return r.device == device && r.key == key; }),
              "pyalloc: allocations on device ", device, " already go to private pool ", describe(key),
              " (beginAllocateToPool twice without endAllocateToPool)");
  Entry& e = entry_locked(device, key);
  // While allocations are routed the device is in capture mode, as PyTorch's
  // own allocator treats every route: the route begins before
  // cudaStreamBeginCapture, so a free on another thread meanwhile records no
  // event on the stream about to be captured (Note [Capture]).
  check_ok(pyalloc_capture_begin(device), "entering capture mode");
  ++e.uses;
  route_list_.push_back(Route{device, key, e.pool, std::move(filter)});
  routes_.store(static_cast<int>(route_list_.size()), std::memory_order_relaxed);
}

void Pools::end_route(int device, PoolKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = std::find_if(route_list_.begin(), route_list_.end(),
                               [&](const Route& r) { return r.device == device && r.key == key; });
  TORCH_CHECK(it != route_list_.end(), "pyalloc: endAllocateToPool of private pool ", describe(key), " on device ",
              device, ", to which no allocation was being routed");
  route_list_.erase(it);
  routes_.store(static_cast<int>(route_list_.size()), std::memory_order_relaxed);
  if (pyalloc_capture_end(device) != PYALLOC_OK) {
    const char* last = pyalloc_last_error();
    TORCH_WARN("pyalloc: leaving capture mode on device ", device, " failed: ", last != nullptr ? last : "");
  }
  // A pool released while routed (release) goes now.
  const auto e = entries_.find({device, key});
  if (e != entries_.end() && e->second.uses == 0) {
    const int pool = e->second.pool;
    entries_.erase(e);
    let_go_locked(pool);
  }
}

int Pools::route_slow(int device, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Route& r : route_list_) {
    if (r.device == device && r.filter(stream)) return r.pool;
  }
  return 0;
}

std::vector<int> Pools::oom_fallbacks(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int> out;
  for (const auto& [k, e] : entries_) {
    if (k.first == device && e.use_on_oom) out.push_back(e.pool);
  }
  return out;
}

// ---- emptying and reading --------------------------------------------------------------

size_t Pools::empty(PoolKey key) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& [k, e] : entries_) {
    if (k.second != key) continue;
    size_t released = 0;
    check_ok(pyalloc_pool_empty_cache(e.pool, &released, nullptr), "emptying a private pool");
    total += released;
  }
  return total;
}

PoolKey Pools::key_of(int pool) {
  if (pool == 0) return {0, 0};
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = keys_.find(pool);
  return it == keys_.end() ? PoolKey{0, 0} : it->second;
}

bool Pools::live_allocations_are(int device, PoolKey key, const std::unordered_set<void*>& expected) {
  int pool = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = entries_.find({device, key});
    if (it == entries_.end()) return expected.empty();
    pool = it->second.pool;
  }
  LiveWalk walk{pool};
  check_ok(pyalloc_snapshot_walk(device, walk_segment, walk_block, &walk), "reading a private pool");
  return walk.live == expected;
}

// ---- captures ------------------------------------------------------------------------

void Pools::capture_begin(int /*device*/) { marks_.fetch_add(1, std::memory_order_relaxed); }

void Pools::capture_end(int /*device*/) { marks_.fetch_sub(1, std::memory_order_relaxed); }

}  // namespace pyalloc::torch_layer
