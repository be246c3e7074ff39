// device_mutex.cpp: the contended half of DeviceMutex (device_mutex.hpp).
#include "device/device_mutex.hpp"

#if !defined(PYALLOC_TSAN)

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pyalloc {

namespace {

constexpr int kSpins = 100;

int* futex_word(std::atomic<int>* state) { return reinterpret_cast<int*>(state); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

void DeviceMutex::lock_contended() {
  for (int i = 0; i < kSpins; ++i) {
    int expected = 0;
    if (state_.load(std::memory_order_relaxed) == 0 &&
        state_.compare_exchange_weak(expected, 1, std::memory_order_acquire)) {
      return;
    }
    cpu_relax();
  }
  // Announce a sleeper (2) and sleep until the holder's unlock wakes us.
  while (state_.exchange(2, std::memory_order_acquire) != 0) {
    syscall(SYS_futex, futex_word(&state_), FUTEX_WAIT_PRIVATE, 2, nullptr, nullptr, 0);
  }
}

void DeviceMutex::wake_one() {
  syscall(SYS_futex, futex_word(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

}  // namespace pyalloc

#endif
