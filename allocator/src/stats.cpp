// stats.cpp: flattening DeviceStats into torch.cuda.memory_stats() keys.
#include "stats.hpp"

#include "json.hpp"

namespace pyalloc {

namespace {

const char* const kStatTypeNames[kNumStatTypes] = {"all", "small_pool", "large_pool"};

void write_array(JsonWriter& w, const std::string& name, const StatArray& a) {
  for (int t = 0; t < kNumStatTypes; ++t) {
    const std::string prefix = name + "." + kStatTypeNames[t] + ".";
    w.key((prefix + "current").c_str()).value(a[t].current);
    w.key((prefix + "peak").c_str()).value(a[t].peak);
    w.key((prefix + "allocated").c_str()).value(a[t].allocated);
    w.key((prefix + "freed").c_str()).value(a[t].freed);
  }
}

template <typename Fn>
void for_each_array(DeviceStats& s, Fn fn) {
  for (StatArray* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                       &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                       &s.requested_bytes}) {
    for (Stat& stat : *a) fn(stat);
  }
}

}  // namespace

void DeviceStats::reset_peaks() {
  for_each_array(*this, [](Stat& s) { s.reset_peak(); });
}

void DeviceStats::reset_accumulated() {
  for_each_array(*this, [](Stat& s) { s.reset_accumulated(); });
  num_alloc_retries = num_ooms = num_sync_all_streams = 0;
  num_device_alloc = num_device_free = 0;
  num_pressure_callbacks = pressure_callback_freed_bytes = 0;
  num_daemon_requests = daemon_freed_bytes = 0;
  num_invalid_free = num_invalid_double_free = num_invalid_size = 0;
}

std::string DeviceStats::to_json(int64_t num_invalid_device, int64_t num_invalid_record_stream) const {
  JsonWriter w;
  w.begin_object();
  write_array(w, "allocation", allocation);
  write_array(w, "segment", segment);
  write_array(w, "active", active);
  write_array(w, "inactive_split", inactive_split);
  write_array(w, "allocated_bytes", allocated_bytes);
  write_array(w, "reserved_bytes", reserved_bytes);
  write_array(w, "active_bytes", active_bytes);
  write_array(w, "inactive_split_bytes", inactive_split_bytes);
  write_array(w, "requested_bytes", requested_bytes);
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
  w.key("num_invalid_free").value(num_invalid_free);
  w.key("num_invalid_double_free").value(num_invalid_double_free);
  w.key("num_invalid_size").value(num_invalid_size);
  w.key("num_invalid_device").value(num_invalid_device);
  w.key("num_invalid_record_stream").value(num_invalid_record_stream);
  w.key("last_oom.request_bytes").value(last_oom.request_bytes);
  w.key("last_oom.reserved_bytes").value(last_oom.reserved_bytes);
  w.key("last_oom.allocated_bytes").value(last_oom.allocated_bytes);
  w.key("last_oom.cached_free_bytes").value(last_oom.cached_free_bytes);
  w.key("last_oom.largest_free_bytes").value(last_oom.largest_free_bytes);
  w.key("last_oom.limit_bytes").value(last_oom.limit_bytes);
  w.end_object();
  return w.str();
}

}  // namespace pyalloc
