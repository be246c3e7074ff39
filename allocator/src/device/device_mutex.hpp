// device_mutex.hpp: the per-device lock.
//
// The fast path takes it once per malloc and once per free, so its cost is
// a large share of a cache hit: uncontended, lock is one compare-and-swap and
// unlock one exchange. Contended, a thread spins briefly (critical sections
// are short), then sleeps on a futex. This is the classic three-state mutex
// (0 free, 1 locked, 2 locked with sleepers).
//
// Under ThreadSanitizer the lock is a std::mutex, which TSan understands; a
// raw futex would hide the happens-before edges it must see.
#pragma once

#include <atomic>
#include <mutex>

#if defined(__SANITIZE_THREAD__)
#define PYALLOC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PYALLOC_TSAN 1
#endif
#endif

namespace pyalloc {

#if defined(PYALLOC_TSAN)

class DeviceMutex {
 public:
  void lock() { mutex_.lock(); }
  bool try_lock() { return mutex_.try_lock(); }
  void unlock() { mutex_.unlock(); }

 private:
  std::mutex mutex_;
};

#else

class DeviceMutex {
 public:
  void lock() {
    int expected = 0;
    if (__builtin_expect(state_.compare_exchange_strong(expected, 1, std::memory_order_acquire), 1)) return;
    lock_contended();
  }
  bool try_lock() {
    int expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire);
  }
  void unlock() {
    if (__builtin_expect(state_.exchange(0, std::memory_order_release) != 1, 0)) wake_one();
  }

 private:
  void lock_contended();
  void wake_one();

  std::atomic<int> state_{0};  // 0 free, 1 locked, 2 locked and someone may sleep
};

#endif

}  // namespace pyalloc
