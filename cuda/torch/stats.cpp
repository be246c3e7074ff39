// stats.cpp: pyalloc's counters as PyTorch's DeviceStats (stats.hpp).
#include "stats.hpp"

#include <pyalloc/pyalloc.h>

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>
#include <vector>

namespace pyalloc::torch_layer {

std::map<std::string, int64_t> parse_counters(const std::string& json) {
  std::map<std::string, int64_t> out;
  size_t i = 0;
  const size_t n = json.size();
  while (i < n) {
    const size_t open = json.find('"', i);
    if (open == std::string::npos) break;
    const size_t close = json.find('"', open + 1);
    if (close == std::string::npos) break;
    size_t v = close + 1;
    while (v < n && std::isspace(static_cast<unsigned char>(json[v]))) ++v;
    if (v >= n || json[v] != ':') {  // a string value, not a key
      i = close + 1;
      continue;
    }
    ++v;
    while (v < n && std::isspace(static_cast<unsigned char>(json[v]))) ++v;
    const char* start = json.c_str() + v;
    char* end = nullptr;
    const long long value = std::strtoll(start, &end, 10);
    const bool integer = end != start && (*end == ',' || *end == '}' || std::isspace(static_cast<unsigned char>(*end)));
    if (integer) out[json.substr(open + 1, close - open - 1)] = value;
    i = v;
  }
  return out;
}

namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;

Stat stat_of(const std::map<std::string, int64_t>& c, const std::string& name, const char* pool) {
  Stat s;
  auto get = [&](const char* field) {
    const auto it = c.find(name + "." + pool + "." + field);
    return it == c.end() ? int64_t{0} : it->second;
  };
  s.current = get("current");
  s.peak = get("peak");
  s.allocated = get("allocated");
  s.freed = get("freed");
  return s;
}

StatArray array_of(const std::map<std::string, int64_t>& c, const std::string& name) {
  StatArray a;
  a[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)] = stat_of(c, name, "all");
  a[static_cast<size_t>(c10::CachingAllocator::StatType::SMALL_POOL)] = stat_of(c, name, "small_pool");
  a[static_cast<size_t>(c10::CachingAllocator::StatType::LARGE_POOL)] = stat_of(c, name, "large_pool");
  return a;
}

int64_t value_of(const std::map<std::string, int64_t>& c, const char* key) {
  const auto it = c.find(key);
  return it == c.end() ? 0 : it->second;
}

}  // namespace

c10::CachingDeviceAllocator::DeviceStats device_stats(int device) {
  pyalloc_clear_last_error();
  std::vector<char> buf(16384);
  size_t len = pyalloc_stats_json(device, buf.data(), buf.size());
  if (len >= buf.size()) {
    buf.resize(len + 1);
    len = pyalloc_stats_json(device, buf.data(), buf.size());
  }
  const char* last = pyalloc_last_error();
  TORCH_CHECK(last == nullptr || *last == '\0', "pyalloc: ", last);
  const std::map<std::string, int64_t> c = parse_counters(std::string(buf.data(), std::min(len, buf.size())));

  c10::CachingDeviceAllocator::DeviceStats s;
  s.allocation = array_of(c, "allocation");
  s.segment = array_of(c, "segment");
  s.active = array_of(c, "active");
  s.inactive_split = array_of(c, "inactive_split");
  s.allocated_bytes = array_of(c, "allocated_bytes");
  s.reserved_bytes = array_of(c, "reserved_bytes");
  s.active_bytes = array_of(c, "active_bytes");
  s.inactive_split_bytes = array_of(c, "inactive_split_bytes");
  s.requested_bytes = array_of(c, "requested_bytes");
  s.num_alloc_retries = value_of(c, "num_alloc_retries");
  s.num_ooms = value_of(c, "num_ooms");
  s.num_sync_all_streams = value_of(c, "num_sync_all_streams");
  s.num_device_alloc = value_of(c, "num_device_alloc");
  s.num_device_free = value_of(c, "num_device_free");
  s.max_split_size = value_of(c, "max_split_size");
  auto oversize = [&](const char* name) {
    Stat o;
    o.current = value_of(c, (std::string(name) + ".current").c_str());
    o.peak = value_of(c, (std::string(name) + ".peak").c_str());
    o.allocated = value_of(c, (std::string(name) + ".allocated").c_str());
    o.freed = value_of(c, (std::string(name) + ".freed").c_str());
    return o;
  };
  s.oversize_allocations = oversize("oversize_allocations");
  s.oversize_segments = oversize("oversize_segments");
  return s;
}

}  // namespace pyalloc::torch_layer
