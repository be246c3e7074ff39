// stress.cpp: a deterministic, seeded, multithreaded stress test of libpyalloc.
//
// Modelled on mimalloc's test/test-stress.c. Each round starts `threads`
// threads; each thread runs `ops` random operations seeded from
// (seed, round, thread index) against the host backend, whose memory is real,
// configured with kDevices devices:
//
//   - malloc on a random device of random sizes (mostly small, some up to a
//     few MiB crossing the 1 MiB small/large pool boundary, a few large ones
//     up to 24 MiB) on one of kStreams streams;
//   - every block is filled with a cookie derived from (thread, index) and
//     verified word by word when it is freed, so memory handed to two owners
//     at once, or reused while still live, shows up as a cookie mismatch;
//   - blocks are handed between threads through a shared transfer array, so
//     most frees happen on another thread than the malloc (and across rounds);
//   - occasional record_stream onto another stream (with event_delay=2 the
//     free then stays pending until the event has been queried twice);
//   - some blocks come from user pools (pyalloc_set_current_pool) and some
//     through the CuPy entry points (freed without a size);
//   - occasional pyalloc_empty_cache, pyalloc_release_cached,
//     pyalloc_check, stats and snapshot JSON, and in-place reconfiguration
//     of runtime keys (max_cached, round_power2) while the other threads keep
//     allocating; attempts to change a layout key, which must be refused
//     (PYALLOC_EBUSY) while blocks are live, possibly after idle devices
//     were already retired;
//   - a few deliberate bad frees (wrong size, interior pointer, wrong
//     device, wrong stream) that the contract says are counted, reported and
//     change nothing.
//
// Then the near-full phase: the threads churn blocks of granule scale whose
// sizes are not whole granules (1 B to 12 MiB) on device 0, stream 0, far
// more than the device holds, so the one arena runs full: stitching, shared
// granules (Note [Shared granules]) and OOMs under contention, blocks handed
// between threads, while a checker thread calls pyalloc_check throughout.
// (Issue 24: a shared window of one granule was counted twice in the arena's
// doubled bytes; only contended runs placed requests that way, and the
// round's own mix never ran the device full enough to share there.) Big
// blocks are filled sparsely (a word every 4 KiB, and the last word) so the
// phase stays fast.
//
// After each round the main thread alone runs a short training loop on
// device 0: kLoopIterations repetitions of the same kLoopRequests requests,
// each freed within its repetition, so that with `--conf plan=1` the
// iteration planner adopts a plan and serves the later repetitions from it,
// and drops it when the next round's threads break the sequence; with
// `--conf lifetime=1` the lifetime learner sees a repeated signature.
//
// OOM (NULL) is allowed under pressure and skipped. After every round the
// main thread calls pyalloc_check on every device and compares the
// live-allocation count with the stats; at the end everything is freed and
// the stats must show nothing allocated or reserved.
//
// The allocator runs with `--vmm` (default all: every pool grows in
// virtual-memory arenas, so stitching under pressure unmaps and remaps real
// memfd granules while other threads verify their cookies; shared: requests
// of every size in the large pool's arena; off: plain segments).
//
// Usage: stress [--threads N] [--rounds N] [--ops N] [--seed N] [--capacity SIZE] [--vmm MODE]
//               [--conf KEYS] [--near-full-threads N] [--near-full-ops N]
// (--near-full-threads 0 skips the near-full phase; defaults 16 and 2000.)
// --conf adds PYALLOC_CONF keys (e.g. plan=1,lifetime=1) after the ones the
// run sets itself.
// Exit 0 with one summary line on success; on failure, what failed and exit 1.
#include <pyalloc/pyalloc.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t KiB = size_t(1) << 10;
constexpr size_t MiB = size_t(1) << 20;

constexpr int kDevices = 2;                 // device 0 gets 3/4 of the blocks
constexpr int kStreams = 4;                 // stream handles 0..3; 0 is the default stream
constexpr size_t kLocalSlots = 64;          // blocks one thread holds at most
constexpr size_t kTransferSlots = 256;      // blocks in flight between threads
constexpr size_t kAlignment = 512;          // every returned pointer is 512-B aligned
constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

struct Options {
  int threads = 8;
  int rounds = 10;
  long ops = 1000;           // operations per thread per round
  uint64_t seed = 42;
  std::string capacity = "96MiB";  // per device; small enough that device 0 runs short: stitching and OOMs
  std::string vmm = "all";
  std::string conf;  // extra PYALLOC_CONF keys
  // The near-full phase: more threads than a round by default, for the
  // interleavings only contention makes (its defect of issue 24 showed with
  // 16 threads and 2,000 operations each, not with 8 and 300).
  int near_full_threads = 16;
  long near_full_ops = 2000;
};

// splitmix64: a good 64-bit mixer; also used to derive seeds and cookies.
uint64_t mix(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() { return state_ = mix(state_); }
  uint64_t below(uint64_t n) { return next() % n; }

 private:
  uint64_t state_;
};

// One allocation. The descriptor travels with the pointer between threads,
// so whichever thread frees the block can verify its cookie.
// Which entry points allocated (and will free) a block.
enum class Api { kTorch, kUserPool, kCupy };

struct Block {
  Api api = Api::kTorch;
  void* ptr = nullptr;
  size_t size = 0;        // the size passed to pyalloc_malloc
  int device = 0;
  uintptr_t stream = 0;   // the stream it was allocated on (and is freed on)
  uint64_t cookie = 0;    // derived from (thread, index)
  int thread = 0;         // the allocating thread
  uint64_t index = 0;     // per-thread allocation index, round in the high bits
  size_t stride = 1;      // cookie words written: every stride-th one, and the last
};

// ---- failure reporting ------------------------------------------------------

std::atomic<bool> g_failed{false};
std::mutex g_report_mutex;

void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void fail(const char* fmt, ...) {
  std::lock_guard<std::mutex> lock(g_report_mutex);
  std::fputs("stress: FAIL: ", stderr);
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fputc('\n', stderr);
  g_failed.store(true);
}

const char* last_error() {
  const char* e = pyalloc_last_error();
  return e != nullptr ? e : "(null)";
}

// ---- cookies ------------------------------------------------------------------

// Word i of a block holds cookie ^ (i * kGolden): a shifted or swapped copy of
// another block, or of this block, never verifies. The tail bytes (size % 8)
// hold bytes of the cookie.
uint8_t tail_byte(uint64_t cookie, size_t i) { return uint8_t(cookie >> ((i % 8) * 8)) ^ 0x5a; }

void fill(const Block& b) {
  auto* words = static_cast<uint64_t*>(b.ptr);
  const size_t nwords = b.size / 8;
  for (size_t i = 0; i < nwords; i += b.stride) words[i] = b.cookie ^ (i * kGolden);
  if (nwords > 0) words[nwords - 1] = b.cookie ^ ((nwords - 1) * kGolden);
  auto* bytes = static_cast<uint8_t*>(b.ptr);
  for (size_t i = nwords * 8; i < b.size; ++i) bytes[i] = tail_byte(b.cookie, i);
}

// Returns true when the whole block still holds its cookie; else the offset
// of the first bad byte.
bool verify(const Block& b, size_t* bad_offset) {
  const auto* words = static_cast<const uint64_t*>(b.ptr);
  const size_t nwords = b.size / 8;
  auto word_ok = [&](size_t i) {
    if (words[i] == (b.cookie ^ (i * kGolden))) return true;
    *bad_offset = i * 8;
    return false;
  };
  for (size_t i = 0; i < nwords; i += b.stride) {
    if (!word_ok(i)) return false;
  }
  if (nwords > 0 && !word_ok(nwords - 1)) return false;
  const auto* bytes = static_cast<const uint8_t*>(b.ptr);
  for (size_t i = nwords * 8; i < b.size; ++i) {
    if (bytes[i] != tail_byte(b.cookie, i)) {
      *bad_offset = i;
      return false;
    }
  }
  return true;
}

// ---- shared state -------------------------------------------------------------

std::atomic<Block*> g_transfer[kTransferSlots];
int g_pool_ids[2] = {0, 0};  // user pools, created before the threads start

struct Counters {
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> allocs{0};
  std::atomic<uint64_t> frees{0};
  std::atomic<uint64_t> cross_thread_frees{0};  // freed by another thread than the allocator
  std::atomic<uint64_t> ooms{0};
  std::atomic<uint64_t> record_streams{0};
  std::atomic<uint64_t> bad_calls{0};           // deliberate bad frees
  std::atomic<uint64_t> checks{0};
  std::atomic<uint64_t> empty_caches{0};
  std::atomic<uint64_t> pool_allocs{0};
  std::atomic<uint64_t> cupy_allocs{0};
  std::atomic<uint64_t> reconfigures{0};
  std::atomic<uint64_t> refused_reconfigures{0};  // layout changes refused with blocks live
  std::atomic<uint64_t> introspections{0};  // stats/snapshot JSON and release_cached
  std::atomic<uint64_t> near_full_ops{0};     // operations of the near-full phases
  std::atomic<uint64_t> captures{0};          // capture bursts (Note [Capture])
  std::atomic<uint64_t> held_pool_empties{0};  // pyalloc_pool_empty_cache of the held pool
  std::atomic<uint64_t> loop_iterations{0};  // repetitions of the main thread's training loop
};
Counters g_count;

// Mostly small, some medium (crossing the 1 MiB small/large boundary), a few
// large ones that need their own large-pool segments.
size_t pick_size(Rng& rng) {
  const uint64_t r = rng.below(1000);
  if (r < 2) return 4 * MiB + rng.below(20 * MiB);             // 0.2%: 4..24 MiB
  if (r < 40) return 64 * KiB + rng.below(4 * MiB - 64 * KiB);  // 3.8%: 64 KiB..4 MiB
  const unsigned bits = unsigned(rng.below(16)) + 1;           // 96%: 1 B..64 KiB, log-spread
  return 1 + rng.below(size_t(1) << bits);
}

void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

// What a malloc returned, as a Block filled with its cookie; nullptr (an
// OOM, counted) when `ptr` is null.
Block* adopt(void* ptr, Api api, size_t size, int device, uintptr_t stream, int thread, uint64_t index,
             size_t stride = 1) {
  if (ptr == nullptr) {
    // Allowed under pressure; the contract says the report is in last_error.
    if (pyalloc_last_error() == nullptr || pyalloc_last_error()[0] == '\0') {
      fail("thread %d: malloc(%zu) returned NULL with no pyalloc_last_error", thread, size);
    }
    g_count.ooms.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  if (reinterpret_cast<uintptr_t>(ptr) % kAlignment != 0) {
    fail("thread %d: malloc(%zu) returned %p, not %zu-byte aligned", thread, size, ptr, kAlignment);
  }
  auto* b = new Block;
  b->api = api;
  b->ptr = ptr;
  b->size = size;
  b->device = device;
  b->stream = stream;
  b->thread = thread;
  b->index = index;
  b->stride = stride;
  b->cookie = mix(mix(uint64_t(thread) + 1) ^ index);
  fill(*b);
  g_count.allocs.fetch_add(1, std::memory_order_relaxed);
  return b;
}

Block* allocate(Rng& rng, int thread, uint64_t index) {
  const size_t size = pick_size(rng);
  const int device = rng.below(4) == 0 ? 1 : 0;
  const uintptr_t stream = rng.below(kStreams);
  const uint64_t api_pick = rng.below(100);
  const Api api = api_pick < 5 ? Api::kUserPool : api_pick < 10 ? Api::kCupy : Api::kTorch;
  void* ptr = nullptr;
  switch (api) {
    case Api::kTorch:
      ptr = pyalloc_malloc(size, device, as_stream(stream));
      break;
    case Api::kUserPool:
      // The current pool is thread-local: it routes only this thread's malloc.
      if (pyalloc_set_current_pool(g_pool_ids[rng.below(2)]) != PYALLOC_OK) {
        fail("thread %d: pyalloc_set_current_pool: %s", thread, last_error());
      }
      ptr = pyalloc_malloc(size, device, as_stream(stream));
      pyalloc_set_current_pool(0);
      break;
    case Api::kCupy:
      pyalloc_cupy_set_stream(as_stream(stream));
      ptr = pyalloc_cupy_malloc(nullptr, size, device);
      break;
  }
  Block* b = adopt(ptr, api, size, device, stream, thread, index);
  if (b == nullptr) return nullptr;
  if (api == Api::kUserPool) g_count.pool_allocs.fetch_add(1, std::memory_order_relaxed);
  if (api == Api::kCupy) g_count.cupy_allocs.fetch_add(1, std::memory_order_relaxed);
  return b;
}

bool verify_or_fail(const Block& b, int thread, const char* when) {
  size_t bad = 0;
  if (verify(b, &bad)) return true;
  fail("thread %d: %s: block %p (size %zu, allocated by thread %d as #%" PRIu64
       ", stream %zu) corrupted at offset %zu",
       thread, when, b.ptr, b.size, b.thread, b.index, size_t(b.stream), bad);
  return false;
}

void release(Block* b, int thread) {
  if (b == nullptr) return;
  verify_or_fail(*b, thread, "free");
  if (b->api == Api::kCupy) {
    pyalloc_cupy_free(nullptr, b->ptr, b->device);  // CuPy does not pass the size
  } else {
    pyalloc_free(b->ptr, b->size, b->device, as_stream(b->stream));
  }
  g_count.frees.fetch_add(1, std::memory_order_relaxed);
  if (b->thread != thread) g_count.cross_thread_frees.fetch_add(1, std::memory_order_relaxed);
  delete b;
}

// Bad calls the contract says are reported and leave the allocator's state
// exactly as it was: the block must stay live and intact.
void bad_free(Block* b, int thread, Rng& rng) {
  const char* kind;
  const uint64_t pick = rng.below(b->api == Api::kCupy ? 3 : 4);
  if (pick == 3) {
    kind = "free on another stream than the malloc's";
    pyalloc_free(b->ptr, b->size, b->device, as_stream((b->stream + 1) % kStreams));
  } else if (pick == 0) {
    kind = "free with the wrong size";
    pyalloc_free(b->ptr, b->size * 2 + 4096, b->device, as_stream(b->stream));
  } else if (pick == 1) {
    // Never a block start: every block start is 512-B aligned.
    kind = "free of an interior pointer";
    pyalloc_free(static_cast<char*>(b->ptr) + 8, b->size, b->device, as_stream(b->stream));
  } else {
    kind = "free on the wrong device";
    pyalloc_free(b->ptr, b->size, 1 - b->device, as_stream(b->stream));
  }
  g_count.bad_calls.fetch_add(1, std::memory_order_relaxed);
  // A weak check (an older message may still be there); the num_invalid*
  // counters compared at the end are the exact one.
  const char* e = pyalloc_last_error();
  if (e == nullptr || e[0] == '\0') fail("thread %d: %s was not reported in pyalloc_last_error", thread, kind);
  // If the block had been freed, another thread's fill would overwrite it
  // before the real free verifies it; check it right away as well.
  verify_or_fail(*b, thread, kind);
}

// Runtime keys may change while blocks are live: the blocks keep their
// sizes, and frees must still find them.
void reconfigure(Rng& rng, int thread) {
  static const char* const kConfs[] = {"max_cached=32MiB", "max_cached=unlimited", "round_power2=4",
                                       "round_power2=0"};
  const char* conf = kConfs[rng.below(4)];
  if (pyalloc_configure(conf) != PYALLOC_OK) {
    fail("thread %d: pyalloc_configure(\"%s\") with blocks live: %s", thread, conf, last_error());
  }
  g_count.reconfigures.fetch_add(1, std::memory_order_relaxed);
}

// A layout key cannot change while `held` (a block this thread owns, so no
// other thread can free it) is live. The refusal may come only after other
// devices, idle at that moment, were retired and must be brought back.
void reconfigure_layout_refused(const Block& held, int thread) {
  const int status = pyalloc_configure("event_delay=3");
  if (status != PYALLOC_EBUSY) {
    fail("thread %d: changing event_delay with block %p live on device %d returned %d, not "
         "PYALLOC_EBUSY (%s)",
         thread, held.ptr, held.device, status, last_error());
  }
  g_count.refused_reconfigures.fetch_add(1, std::memory_order_relaxed);
}

// snprintf-style introspection racing with allocation: sized, then filled;
// the filled text must be NUL-terminated within the buffer.
void introspect(Rng& rng, int thread) {
  g_count.introspections.fetch_add(1, std::memory_order_relaxed);
  const uint64_t what = rng.below(3);
  if (what == 2 && rng.below(4) == 0) {  // the held pool's own emptying (Note [Held pools])
    g_count.held_pool_empties.fetch_add(1, std::memory_order_relaxed);
    if (pyalloc_pool_empty_cache(g_pool_ids[1], nullptr, nullptr) != PYALLOC_OK) {
      fail("thread %d: pyalloc_pool_empty_cache: %s", thread, last_error());
    }
    return;
  }
  if (what == 2) {
    size_t released = 0;
    if (pyalloc_release_cached(int(rng.below(kDevices)), rng.below(2) * 2 * MiB, &released) != PYALLOC_OK) {
      fail("thread %d: pyalloc_release_cached: %s", thread, last_error());
    }
    return;
  }
  const int device = int(rng.below(kDevices));
  auto call = [what, device](char* buf, size_t len) {
    return what == 0 ? pyalloc_stats_json(device, buf, len) : pyalloc_snapshot_json(buf, len);
  };
  const size_t len = call(nullptr, 0);
  std::vector<char> buf(len + 1, 'x');
  call(buf.data(), buf.size());
  if (std::memchr(buf.data(), '\0', buf.size()) == nullptr || buf[0] != '{') {
    fail("thread %d: %s JSON is not a NUL-terminated object", thread, what == 0 ? "stats" : "snapshot");
  }
}

void check_or_fail(int device, int thread, const char* when) {
  g_count.checks.fetch_add(1, std::memory_order_relaxed);
  if (pyalloc_check(device) != 0) {
    fail("thread %d: pyalloc_check(%d) %s: %s", thread, device, when, last_error());
  }
}

// A CUDA graph capture on one device: a few allocations and frees of this
// thread's while every thread's calls on that device meet the capture (frees
// deferred, no ladder), then its end, with an invariant walk inside and after.
void capture_burst(Rng& rng, int thread, std::vector<Block*>& local, uint64_t& next_index) {
  const int device = int(rng.below(kDevices));
  if (pyalloc_capture_begin(device) != PYALLOC_OK) fail("thread %d: pyalloc_capture_begin: %s", thread, last_error());
  for (int i = 0; i < 8; ++i) {
    Block*& slot = local[rng.below(local.size())];
    release(slot, thread);
    slot = rng.below(2) == 0 ? allocate(rng, thread, next_index++) : nullptr;
  }
  check_or_fail(device, thread, "during a capture");
  if (pyalloc_capture_end(device) != PYALLOC_OK) fail("thread %d: pyalloc_capture_end: %s", thread, last_error());
  check_or_fail(device, thread, "after a capture");
  g_count.captures.fetch_add(1, std::memory_order_relaxed);
}

// One thread's share of one round.
void stress_thread(const Options& opt, int round, int thread) {
  Rng rng(mix(opt.seed ^ mix(uint64_t(round) << 32 | uint64_t(thread))));
  std::vector<Block*> local(kLocalSlots, nullptr);
  uint64_t next_index = uint64_t(round) << 40;

  for (long op = 0; op < opt.ops && !g_failed.load(std::memory_order_relaxed); ++op) {
    const uint64_t r = rng.below(10000);
    Block*& slot = local[rng.below(kLocalSlots)];
    if (r < 4500) {  // 45%: allocate into a slot, freeing what was there
      release(slot, thread);
      slot = allocate(rng, thread, next_index++);
    } else if (r < 7500) {  // 30%: free
      release(slot, thread);
      slot = nullptr;
    } else if (r < 9500) {  // 20%: swap with the transfer array (hands blocks to other threads)
      slot = g_transfer[rng.below(kTransferSlots)].exchange(slot, std::memory_order_acq_rel);
    } else if (r < 9890) {  // 3.9%: record_stream onto another stream
      if (slot != nullptr) {
        const uintptr_t other = (slot->stream + 1 + rng.below(kStreams - 1)) % kStreams;
        pyalloc_record_stream(slot->ptr, as_stream(other));
        g_count.record_streams.fetch_add(1, std::memory_order_relaxed);
      }
    } else if (r < 9900) {  // 0.1%: a capture, while the others go on (Note [Capture])
      capture_burst(rng, thread, local, next_index);
    } else if (r < 9950) {  // 0.5%: invariant walk while others allocate
      check_or_fail(int(rng.below(kDevices)), thread, "during the run");
    } else if (r < 9970) {  // 0.2%: deliberate bad free
      if (slot != nullptr) bad_free(slot, thread, rng);
    } else if (r < 9980) {  // 0.1%: empty_cache while others allocate
      pyalloc_empty_cache();
      g_count.empty_caches.fetch_add(1, std::memory_order_relaxed);
    } else if (r < 9990) {  // 0.1%: stats, snapshot or release_cached while others allocate
      introspect(rng, thread);
    } else if (r < 9995) {  // 0.05%: change runtime keys in place
      reconfigure(rng, thread);
    } else if (r < 9998) {  // 0.03%: try to change a layout key
      if (slot != nullptr) reconfigure_layout_refused(*slot, thread);
    }
    // else 0.02%: nothing (keeps the mix easy to retune)
    g_count.ops.fetch_add(1, std::memory_order_relaxed);
  }
  for (Block*& b : local) {
    release(b, thread);
    b = nullptr;
  }
}

// ---- the near-full phase ------------------------------------------------------

constexpr size_t kNearFullSlots = 6;       // blocks one thread holds at most
constexpr size_t kNearFullTransfer = 64;   // blocks in flight between threads
constexpr uint64_t kNearFullIndex = uint64_t(1) << 62;  // keeps cookies apart from the round's
std::atomic<Block*> g_near_full_transfer[kNearFullTransfer];
uint64_t g_near_full_shared = 0;  // shared granules made in the near-full phases (main thread only)

// Granule scale, rarely a whole number of granules: the sizes that leave
// slivers, as in a training step's activations.
size_t pick_near_full_size(Rng& rng) {
  switch (rng.below(3)) {
    case 0: return 1 + rng.below(4 * KiB);
    case 1: return 4 * KiB + rng.below(MiB);
    default: return MiB + rng.below(11 * MiB);
  }
}

void near_full_thread(const Options& opt, int round, int thread) {
  Rng rng(mix(opt.seed ^ mix(uint64_t(round) << 32 | uint64_t(thread)) ^ 0x4ea7f011ull));
  Block* local[kNearFullSlots] = {};
  uint64_t next_index = kNearFullIndex | uint64_t(round) << 40;
  for (long op = 0; op < opt.near_full_ops && !g_failed.load(std::memory_order_relaxed); ++op) {
    Block*& slot = local[rng.below(kNearFullSlots)];
    const uint64_t r = rng.below(100);
    if (r < 55) {
      release(slot, thread);
      const size_t size = pick_near_full_size(rng);
      slot = adopt(pyalloc_malloc(size, 0, nullptr), Api::kTorch, size, 0, 0, thread, next_index++,
                   size > 256 * KiB ? 512 : 1);
    } else if (r < 80) {
      release(slot, thread);
      slot = nullptr;
    } else {
      slot = g_near_full_transfer[rng.below(kNearFullTransfer)].exchange(slot, std::memory_order_acq_rel);
    }
    g_count.near_full_ops.fetch_add(1, std::memory_order_relaxed);
  }
  for (Block*& b : local) release(b, thread);
}

// ---- stats --------------------------------------------------------------------

std::string stats_json(int device) {
  const size_t len = pyalloc_stats_json(device, nullptr, 0);
  std::string buf(len + 1, '\0');
  const size_t got = pyalloc_stats_json(device, &buf[0], buf.size());
  buf.resize(got < len ? got : len);
  return buf;
}

// Value of "key": N in the flat stats JSON; false when the key is missing.
bool stat_value(const std::string& json, const std::string& key, uint64_t* out) {
  const std::string quoted = "\"" + key + "\"";
  const size_t at = json.find(quoted);
  if (at == std::string::npos) return false;
  const size_t colon = json.find(':', at + quoted.size());
  if (colon == std::string::npos) return false;
  char* end = nullptr;
  *out = std::strtoull(json.c_str() + colon + 1, &end, 10);
  return end != json.c_str() + colon + 1;
}

uint64_t stat_or_fail(const std::string& json, const std::string& key) {
  uint64_t v = 0;
  if (!stat_value(json, key, &v)) fail("stats JSON has no \"%s\": %s", key.c_str(), json.c_str());
  return v;
}

// Sum of every counter whose key begins with "num_invalid".
uint64_t sum_invalid_counters(const std::string& json, int* nkeys) {
  uint64_t sum = 0;
  *nkeys = 0;
  for (size_t at = json.find("\"num_invalid"); at != std::string::npos;
       at = json.find("\"num_invalid", at + 1)) {
    const size_t close = json.find('"', at + 1);
    uint64_t v = 0;
    if (close != std::string::npos && stat_value(json, json.substr(at + 1, close - at - 1), &v)) {
      sum += v;
      ++*nkeys;
    }
  }
  return sum;
}

uint64_t g_near_full_moved = 0;  // granules moved in the near-full phases' passes of one thread

void configure_or_fail(const char* conf) {
  if (pyalloc_configure(conf) != PYALLOC_OK) fail("pyalloc_configure(\"%s\"): %s", conf, last_error());
}

// Runs the near-full phase on device 0 with `opt.near_full_threads` threads and one
// more that checks the invariants until they are done; then one thread alone runs the
// same churn with move=1 (moving slivers copies live bytes and remaps their granule: no
// other thread may touch live memory meanwhile, Note [Moving slivers]), every block's
// cookies verified when it is freed, while the checker goes on. Returns the shared
// granules it made.
uint64_t near_full_phase(const Options& opt, int round) {
  const uint64_t before = stat_or_fail(stats_json(0), "num_shared_granules");
  std::atomic<bool> done{false};
  std::thread checker([&] {
    while (!done.load() && !g_failed.load()) {
      check_or_fail(0, -1, "near a full device while threads run");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  std::vector<std::thread> threads;
  threads.reserve(size_t(opt.near_full_threads));
  for (int t = 0; t < opt.near_full_threads; ++t) threads.emplace_back(near_full_thread, std::cref(opt), round, t);
  for (auto& th : threads) th.join();
  for (auto& slot : g_near_full_transfer) release(slot.exchange(nullptr), -1);
  const uint64_t moved_before = stat_or_fail(stats_json(0), "num_moved_granules");
  configure_or_fail("move=1");
  near_full_thread(opt, round, opt.near_full_threads);
  configure_or_fail("move=0");
  g_near_full_moved += stat_or_fail(stats_json(0), "num_moved_granules") - moved_before;
  done.store(true);
  checker.join();
  for (auto& slot : g_near_full_transfer) release(slot.exchange(nullptr), -1);
  check_or_fail(0, -1, "after the near-full phase");
  return stat_or_fail(stats_json(0), "num_shared_granules") - before;
}

// ---- the main thread's training loop ------------------------------------------

constexpr int kLoopIterations = 6;
constexpr int kLoopRequests = 10;

// kLoopIterations repetitions of one sequence of kLoopRequests requests on
// device 0, stream 0 (sizes from the seed, 256 KiB to 6 MiB), freed in
// reverse order within each repetition. Runs alone: the other threads have
// joined, so the allocator sees the sequence repeat unbroken.
void training_loop(const Options& opt, int round) {
  Rng sizes(mix(opt.seed ^ 0x10095eedull));
  size_t size[kLoopRequests];
  for (size_t& n : size) n = 256 * KiB + sizes.below(6 * MiB - 256 * KiB);
  for (int it = 0; it < kLoopIterations && !g_failed.load(); ++it) {
    Block* live[kLoopRequests] = {};
    for (int k = 0; k < kLoopRequests; ++k) {
      const uint64_t index = (uint64_t(round) << 32) | uint64_t(it * kLoopRequests + k);
      live[k] = adopt(pyalloc_malloc(size[k], 0, nullptr), Api::kTorch, size[k], 0, 0, -1, index);
    }
    for (int k = kLoopRequests - 1; k >= 0; --k) release(live[k], -1);
    g_count.loop_iterations.fetch_add(1, std::memory_order_relaxed);
  }
}

// ---- command line -------------------------------------------------------------

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "stress: %s\nusage: stress [--threads N] [--rounds N] [--ops N] [--seed N] "
               "[--capacity SIZE] [--vmm auto|on|shared|all|off] [--conf KEYS]\n"
               "              [--near-full-threads N] [--near-full-ops N]\n",
               why);
  std::exit(2);
}

uint64_t parse_number(const char* flag, const char* text, uint64_t min) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 0);
  if (text[0] == '-' || end == text || *end != '\0' || errno != 0 || v < min) {
    usage((std::string("bad value for ") + flag + ": " + text).c_str());
  }
  return v;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") usage("a seeded multithreaded stress test of libpyalloc");
    if (i + 1 >= argc) usage(("missing value for " + flag).c_str());
    const char* value = argv[++i];
    if (flag == "--threads") opt.threads = int(parse_number("--threads", value, 1));
    else if (flag == "--rounds") opt.rounds = int(parse_number("--rounds", value, 1));
    else if (flag == "--ops") opt.ops = long(parse_number("--ops", value, 1));
    else if (flag == "--seed") opt.seed = parse_number("--seed", value, 0);
    else if (flag == "--capacity") opt.capacity = value;
    else if (flag == "--vmm") opt.vmm = value;
    else if (flag == "--conf") opt.conf = value;
    else if (flag == "--near-full-threads") opt.near_full_threads = int(parse_number("--near-full-threads", value, 0));
    else if (flag == "--near-full-ops") opt.near_full_ops = long(parse_number("--near-full-ops", value, 0));
    else usage(("unknown option " + flag).c_str());
  }
  if (opt.threads > 1024 || opt.near_full_threads > 1024) usage("--threads and --near-full-threads must be at most 1024");
  return opt;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);

  // Every key the run depends on is set, so PYALLOC_CONF in the environment
  // cannot change what is tested. move=0: the threads touch their blocks while
  // others allocate, which moving slivers rules out (Note [Moving slivers]);
  // the near-full phase runs a pass of one thread with move=1 (near_full_phase).
  const std::string conf = "backend=host,devices=" + std::to_string(kDevices) + ",capacity=" + opt.capacity +
                           ",event_delay=2,oom_report=0,memory_fraction=1,max_cached=unlimited,round_power2=0,move=0,vmm=" + opt.vmm +
                           (opt.conf.empty() ? "" : "," + opt.conf);
  if (pyalloc_configure(conf.c_str()) != PYALLOC_OK) {
    std::fprintf(stderr, "stress: FAIL: pyalloc_configure(\"%s\"): %s\n", conf.c_str(), last_error());
    return 1;
  }
  for (auto& slot : g_transfer) slot.store(nullptr);
  for (auto& slot : g_near_full_transfer) slot.store(nullptr);
  const char* const kPoolNames[2] = {"stress-a", "stress-b"};
  for (int i = 0; i < 2; ++i) {
    if (pyalloc_pool_create(kPoolNames[i], &g_pool_ids[i]) != PYALLOC_OK) {
      std::fprintf(stderr, "stress: FAIL: pyalloc_pool_create(\"%s\"): %s\n", kPoolNames[i], last_error());
      return 1;
    }
  }
  // The second pool is held, as a CUDA graph's is: empty_cache and the ladder leave its memory.
  if (pyalloc_pool_hold(g_pool_ids[1], 1) != PYALLOC_OK) {
    std::fprintf(stderr, "stress: FAIL: pyalloc_pool_hold: %s\n", last_error());
    return 1;
  }

  for (int round = 0; round < opt.rounds && !g_failed.load(); ++round) {
    std::vector<std::thread> threads;
    threads.reserve(size_t(opt.threads));
    for (int t = 0; t < opt.threads; ++t) threads.emplace_back(stress_thread, std::cref(opt), round, t);
    for (auto& th : threads) th.join();
    if (g_failed.load()) break;
    if (opt.near_full_threads > 0) g_near_full_shared += near_full_phase(opt, round);
    if (g_failed.load()) break;
    training_loop(opt, round);

    // Between rounds only the transfer array holds blocks: the stats must agree.
    uint64_t live[kDevices] = {};
    for (auto& slot : g_transfer) {
      if (const Block* b = slot.load()) ++live[b->device];
    }
    for (int d = 0; d < kDevices; ++d) {
      check_or_fail(d, -1, "after a round");
      const uint64_t counted = stat_or_fail(stats_json(d), "allocation.all.current");
      if (!g_failed.load() && counted != live[d]) {
        fail("after round %d: device %d: allocation.all.current is %" PRIu64 " but %" PRIu64
             " blocks are live",
             round, d, counted, live[d]);
      }
    }
  }
  if (g_failed.load()) return 1;

  for (auto& slot : g_transfer) release(slot.exchange(nullptr), -1);
  for (int d = 0; d < kDevices; ++d) check_or_fail(d, -1, "after freeing everything");
  // empty_cache synchronizes pending (record_stream) frees and releases every
  // fully free segment; with nothing live, and the held pool let go, that is all of them.
  if (pyalloc_pool_hold(g_pool_ids[1], 0) != PYALLOC_OK) fail("pyalloc_pool_hold(0): %s", last_error());
  pyalloc_empty_cache();

  uint64_t ooms = 0;
  uint64_t stitches = 0;
  uint64_t shared = 0;
  uint64_t plans = 0;
  uint64_t plan_served = 0;
  uint64_t lifetime_long = 0;
  uint64_t invalid = 0;
  for (int d = 0; d < kDevices; ++d) {
    check_or_fail(d, -1, "after the final empty_cache");
    const std::string json = stats_json(d);
    const uint64_t allocated = stat_or_fail(json, "allocated_bytes.all.current");
    const uint64_t allocations = stat_or_fail(json, "allocation.all.current");
    const uint64_t reserved = stat_or_fail(json, "reserved_bytes.all.current");
    ooms += stat_or_fail(json, "num_ooms");
    stitches += stat_or_fail(json, "num_stitches");
    shared += stat_or_fail(json, "num_shared_granules");
    plans += stat_or_fail(json, "num_plans");
    plan_served += stat_or_fail(json, "plan_served");
    lifetime_long += stat_or_fail(json, "lifetime_long");
    int invalid_keys = 0;
    invalid += sum_invalid_counters(json, &invalid_keys);
    if (invalid_keys == 0) fail("stats JSON has no num_invalid* counter: %s", json.c_str());
    if (allocated != 0) fail("at the end device %d: allocated_bytes.all.current is %" PRIu64 ", not 0", d, allocated);
    if (allocations != 0) fail("at the end device %d: allocation.all.current is %" PRIu64 ", not 0", d, allocations);
    if (reserved != 0) {
      fail("after freeing everything and empty_cache, device %d: reserved_bytes.all.current is %" PRIu64
           ", not 0",
           d, reserved);
    }
  }
  if (ooms != g_count.ooms.load()) {
    fail("num_ooms sums to %" PRIu64 " but malloc returned NULL %" PRIu64 " times", ooms,
         uint64_t(g_count.ooms.load()));
  }
  // Each bad call is counted exactly once, on the device it named.
  if (invalid != g_count.bad_calls.load()) {
    fail("num_invalid* counters sum to %" PRIu64 " but %" PRIu64 " bad calls were made", invalid,
         uint64_t(g_count.bad_calls.load()));
  }
  if (g_failed.load()) return 1;

  std::printf("stress: ok ops=%" PRIu64 " allocs=%" PRIu64 " frees=%" PRIu64
              " cross_thread_frees=%" PRIu64 " ooms=%" PRIu64 " record_streams=%" PRIu64
              " bad_calls=%" PRIu64 " checks=%" PRIu64 " empty_caches=%" PRIu64
              " pool_allocs=%" PRIu64 " cupy_allocs=%" PRIu64 " reconfigures=%" PRIu64
              " refused_reconfigures=%" PRIu64 " introspections=%" PRIu64 " stitches=%" PRIu64 " shared=%" PRIu64 " near_full_ops=%" PRIu64 " near_full_shared=%" PRIu64
              " near_full_moved=%" PRIu64 " captures=%" PRIu64 " held_pool_empties=%" PRIu64
              " loop_iterations=%" PRIu64 " plans=%" PRIu64 " plan_served=%" PRIu64 " lifetime_long=%" PRIu64
              " threads=%d rounds=%d seed=%" PRIu64 "\n",
              uint64_t(g_count.ops.load()), uint64_t(g_count.allocs.load()),
              uint64_t(g_count.frees.load()), uint64_t(g_count.cross_thread_frees.load()),
              uint64_t(g_count.ooms.load()), uint64_t(g_count.record_streams.load()),
              uint64_t(g_count.bad_calls.load()), uint64_t(g_count.checks.load()),
              uint64_t(g_count.empty_caches.load()), uint64_t(g_count.pool_allocs.load()),
              uint64_t(g_count.cupy_allocs.load()), uint64_t(g_count.reconfigures.load()),
              uint64_t(g_count.refused_reconfigures.load()), uint64_t(g_count.introspections.load()),
              stitches, shared, uint64_t(g_count.near_full_ops.load()), g_near_full_shared, g_near_full_moved,
              uint64_t(g_count.captures.load()), uint64_t(g_count.held_pool_empties.load()),
              uint64_t(g_count.loop_iterations.load()), plans, plan_served, lifetime_long, opt.threads,
              opt.rounds, opt.seed);
  return 0;
}
