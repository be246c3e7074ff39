// stats.cpp: flattening DeviceStats into torch.cuda.memory_stats() keys.
#include "observe/stats.hpp"

#include "ground/json.hpp"

namespace pyalloc {

namespace {

const char* const kStatTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};
constexpr StatType kAllTypes[kNumStatTypes] = {kStatAll, kStatSmall, kStatLarge};

void write_view(JsonWriter& w, const std::string& name, const StatView& view) {
  for (int t = 0; t < kNumStatTypes; ++t) {
    const std::string prefix = name + "." + kStatTypeNames[t] + ".";
    w.key((prefix + "current").c_str()).value(view[t].current);
    w.key((prefix + "peak").c_str()).value(view[t].peak);
    w.key((prefix + "allocated").c_str()).value(view[t].allocated);
    w.key((prefix + "freed").c_str()).value(view[t].freed);
  }
}

template <typename Fn>
void for_each_counter(DeviceStats& s, Fn fn) {
  for (Counter* c : {&s.allocation, &s.segment, &s.inactive_split, &s.allocated_bytes, &s.reserved_bytes,
                     &s.inactive_split_bytes, &s.requested_bytes, &s.pending, &s.pending_bytes}) {
    fn(*c);
  }
}

}  // namespace

// ---- Counter (Note [Counters]) ----------------------------------------------------

Stat Counter::get(StatType t) const {
  if (t != kStatAll) {
    const Figures& f = by_type_[t];
    return Stat{f.current, f.peak, f.decreased + (f.current - f.current_at_reset), f.decreased};
  }
  const Stat small = get(kStatSmall);
  const Stat large = get(kStatLarge);
  const int64_t all = small.current + large.current;
  return Stat{all, by_type_[kStatAll].peak, small.allocated + large.allocated, small.freed + large.freed};
}

StatView Counter::view() const {
  StatView v;
  for (StatType t : kAllTypes) v[t] = get(t);
  return v;
}

void Counter::reset_peak() {
  for (Figures& f : by_type_) f.peak = f.current;
  by_type_[kStatAll].peak = current(kStatAll);
}

void Counter::reset_accumulated() {
  for (Figures& f : by_type_) {
    f.decreased = 0;
    f.current_at_reset = f.current;
  }
}

// ---- DeviceStats -----------------------------------------------------------------------

StatView DeviceStats::active_view(const Counter& held, const Counter& pending,
                                  const int64_t (&peak)[kNumStatTypes]) {
  StatView v;
  for (StatType t : kAllTypes) {
    const Stat h = held.get(t);
    const Stat p = pending.get(t);
    v[t].current = h.current + p.current;
    v[t].allocated = h.allocated;
    v[t].freed = h.freed - p.allocated + p.freed;
    v[t].peak = h.peak > peak[t] ? h.peak : peak[t];
  }
  return v;
}

void DeviceStats::note_active_peaks() {
  for (StatType t : kAllTypes) {
    const int64_t active_now = allocation.current(t) + pending.current(t);
    const int64_t active_bytes_now = allocated_bytes.current(t) + pending_bytes.current(t);
    if (active_now > active_peak[t]) active_peak[t] = active_now;
    if (active_bytes_now > active_bytes_peak[t]) active_bytes_peak[t] = active_bytes_now;
  }
}

void DeviceStats::reset_peaks() {
  for_each_counter(*this, [](Counter& c) { c.reset_peak(); });
  for (StatType t : kAllTypes) {
    active_peak[t] = allocation.current(t) + pending.current(t);
    active_bytes_peak[t] = allocated_bytes.current(t) + pending_bytes.current(t);
  }
}

void DeviceStats::reset_accumulated() {
  for_each_counter(*this, [](Counter& c) { c.reset_accumulated(); });
  num_alloc_retries = num_ooms = num_sync_all_streams = 0;
  num_device_alloc = num_device_free = 0;
  num_pressure_callbacks = pressure_callback_freed_bytes = 0;
  num_daemon_requests = daemon_freed_bytes = 0;
  num_stitches = stitched_bytes = num_shared_granules = 0;
  num_moved_granules = moved_bytes = num_merged_groups = num_sliver_indexes = 0;
  num_reuses = reused_bytes = 0;
  num_plans = num_plan_drops = plan_served = plan_misses = lifetime_long = 0;
  num_invalid_free = num_invalid_double_free = num_invalid_size = num_invalid_free_stream = 0;
}

void DeviceStats::write_fields(JsonWriter& w, int64_t num_invalid_device, int64_t num_invalid_record_stream) const {
  write_view(w, "allocation", allocation.view());
  write_view(w, "segment", segment.view());
  write_view(w, "active", active());
  write_view(w, "inactive_split", inactive_split.view());
  write_view(w, "allocated_bytes", allocated_bytes.view());
  write_view(w, "reserved_bytes", reserved_bytes.view());
  write_view(w, "active_bytes", active_bytes());
  write_view(w, "inactive_split_bytes", inactive_split_bytes.view());
  write_view(w, "requested_bytes", requested_bytes.view());
  // pyalloc never refuses to split a block by size (PyTorch's
  // max_split_size), so there are no oversize blocks; the keys exist so that
  // tools written for PyTorch (memory_summary) find them.
  for (const char* name : {"oversize_allocations", "oversize_segments"}) {
    for (const char* field : {"current", "peak", "allocated", "freed"}) {
      w.key((std::string(name) + "." + field).c_str()).value(int64_t{0});
    }
  }
  w.key("max_split_size").value(int64_t{-1});
  w.key("num_alloc_retries").value(num_alloc_retries);
  w.key("num_ooms").value(num_ooms);
  w.key("num_sync_all_streams").value(num_sync_all_streams);
  w.key("num_device_alloc").value(num_device_alloc);
  w.key("num_device_free").value(num_device_free);
  w.key("num_pressure_callbacks").value(num_pressure_callbacks);
  w.key("pressure_callback_freed_bytes").value(pressure_callback_freed_bytes);
  w.key("num_daemon_requests").value(num_daemon_requests);
  w.key("daemon_freed_bytes").value(daemon_freed_bytes);
  w.key("num_stitches").value(num_stitches);
  w.key("stitched_bytes").value(stitched_bytes);
  w.key("num_shared_granules").value(num_shared_granules);
  w.key("num_moved_granules").value(num_moved_granules);
  w.key("moved_bytes").value(moved_bytes);
  w.key("num_merged_groups").value(num_merged_groups);
  w.key("num_sliver_indexes").value(num_sliver_indexes);
  w.key("num_reuses").value(num_reuses);
  w.key("reused_bytes").value(reused_bytes);
  w.key("num_plans").value(num_plans);
  w.key("num_plan_drops").value(num_plan_drops);
  w.key("plan_served").value(plan_served);
  w.key("plan_misses").value(plan_misses);
  w.key("lifetime_long").value(lifetime_long);
  w.key("num_invalid_free").value(num_invalid_free);
  w.key("num_invalid_double_free").value(num_invalid_double_free);
  w.key("num_invalid_size").value(num_invalid_size);
  w.key("num_invalid_free_stream").value(num_invalid_free_stream);
  w.key("num_invalid_device").value(num_invalid_device);
  w.key("num_invalid_record_stream").value(num_invalid_record_stream);
  w.key("last_oom.request_bytes").value(last_oom.request_bytes);
  w.key("last_oom.reserved_bytes").value(last_oom.reserved_bytes);
  w.key("last_oom.allocated_bytes").value(last_oom.allocated_bytes);
  w.key("last_oom.cached_free_bytes").value(last_oom.cached_free_bytes);
  w.key("last_oom.largest_free_bytes").value(last_oom.largest_free_bytes);
  w.key("last_oom.limit_bytes").value(last_oom.limit_bytes);
}

}  // namespace pyalloc
