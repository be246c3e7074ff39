// stats.hpp: pyalloc's counters as PyTorch's DeviceStats.
//
// CUDAAllocator::getDeviceStats is what torch.cuda.memory_stats() and every
// function built on it (memory_allocated, max_memory_reserved, memory_summary)
// read from C++. pyalloc_stats_json already writes PyTorch's keys
// ("allocated_bytes.all.current", ...); this reads them back into the struct.
// c10 only: tested on the CPU build (torch.ops.pyalloc.device_stats).
#pragma once

#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>
#include <map>
#include <string>

namespace pyalloc::torch_layer {

// The integer members of a flat JSON object ({"key": 12, ...}); other values
// are skipped.
std::map<std::string, int64_t> parse_counters(const std::string& json);

// pyalloc_stats_json(device) as DeviceStats. Throws c10::Error when the
// device is out of range.
c10::CachingDeviceAllocator::DeviceStats device_stats(int device);

}  // namespace pyalloc::torch_layer
