// countdown_events.hpp: events for backends without a device (host, sim).
//
// There is no asynchronous work, so an event could complete at once; to
// exercise the pending-free paths an event completes only after it has been
// queried `delay` times (config key event_delay). Synchronize completes it.
// One table per device, used under that device's lock.
#pragma once

#include <vector>

#include "backends/backend.hpp"

namespace pyalloc {

class CountdownEvents {
 public:
  explicit CountdownEvents(int delay) : delay_(delay) {}

  EventHandle record() {
    size_t index;
    if (!free_.empty()) {
      index = free_.back();
      free_.pop_back();
    } else {
      index = remaining_.size();
      remaining_.push_back(0);
    }
    remaining_[index] = delay_;
    return static_cast<EventHandle>(index + 1);
  }
  bool query(EventHandle e) {
    int& left = remaining_.at(e - 1);
    if (left == 0) return true;
    --left;
    return false;
  }
  void synchronize(EventHandle e) { remaining_.at(e - 1) = 0; }
  void release(EventHandle e) { free_.push_back(e - 1); }

 private:
  int delay_;
  std::vector<int> remaining_;  // queries left before completion, by handle - 1
  std::vector<size_t> free_;
};

}  // namespace pyalloc
