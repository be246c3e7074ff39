// config.hpp: the validated configuration passed to the allocator.
//
// Parsed from PYALLOC_CONF or pyalloc_configure(): comma-separated key=value.
// Every key is listed once in kConfigKeys (config.cpp), which is also the
// source of the README's table. The mechanism never reads the environment:
// a Config is built, validated, and handed in at construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyalloc {

// Limits a configuration is checked against (parse_config).
constexpr size_t kMinCapacity = size_t{2} << 20;     // one granule: less and every allocation fails
constexpr size_t kTraceEventBytes = 48;              // sizeof(TraceEvent), asserted in observe/trace.hpp
constexpr size_t kMaxTraceBytes = size_t{1} << 30;   // all devices' trace rings together
constexpr size_t kMinExtent = size_t{2} << 20;       // Note [Extents]: one granule
constexpr size_t kMaxExtent = size_t{1} << 30;       // the largest chunk an arena creates or imports


enum class BackendKind { kCuda, kHost, kSim };

// Virtual-memory arenas (Note [Arenas]): off; on (the large and user pools
// grow in arenas, the small pool in plain segments); shared (no small pool:
// requests of every size share the large pool's arena, Note [One arena for
// small and large]); all (the small pool in an arena of its own); auto
// (shared for the host and sim backends, off on cuda until measured on a
// GPU).
enum class VmmMode { kAuto, kOn, kShared, kAll, kOff };

const char* backend_name(BackendKind kind);

struct Config {
  BackendKind backend = BackendKind::kCuda;
  int devices = 1;                  // host/sim: number of devices
  size_t capacity = 0;              // host/sim: bytes per device; 0 = backend default
  double memory_fraction = 1.0;     // reserved <= fraction * device total
  size_t max_cached = SIZE_MAX;     // cap on cached-but-free bytes (SIZE_MAX = none)
  size_t small_segment = 2u << 20;  // segment size of the small pool
  size_t large_segment = 20u << 20; // segment size for 1..large_segment/2 requests
  int round_power2 = 0;             // divisions per power-of-two interval; 0 = off
  size_t trace = 0;                 // trace ring entries; 0 = off
  int event_delay = 0;              // host: an event completes after this many queries
  bool oom_report = true;           // print the OOM report to stderr
  bool registry = true;             // publish a record for gpumemd (/dev/shm)
  bool pressure_opt_in = false;     // trim when gpumemd relays another process's pressure
  std::string daemon_socket = "auto";  // gpumemd's socket for ladder step 4; "off" disables
  VmmMode vmm = VmmMode::kAuto;     // virtual-memory arenas and stitching
  bool plan = false;                // iteration plans (Note [Iteration plans]); off: see README
  bool lifetime = false;            // lifetime-aware placement (Note [Lifetime-aware placement]); off: see README
  bool share = true;                // near a full device, map used granules' free ends twice (Note [Shared granules])
  // before an OOM, copy granules' live ends together and give granules back (Note [Moving slivers]):
  // 1, 0, or -1 (auto): on, but for the host backend, where the program's own threads read and
  // write its blocks while one is moved (a review's eight threads: a segfault in 1 run of 4)
  int move = -1;
  bool moving() const { return move < 0 ? backend != BackendKind::kHost : move != 0; }
  bool reuse = true;                // an arena takes cached free granules before new ones (Note [Reuse before growing])
  size_t extent = size_t{32} << 20; // the largest physical chunk an arena's growth creates (Note [Extents])

  // The mode in effect (kAuto resolved): kOn, kShared, kAll or kOff.
  // The mode `vmm` stands for: auto is shared on sim and host; on cuda,
  // shared when the process sees one device that supports virtual memory,
  // off otherwise (other devices would need access granted to every mapping
  // for peer copies, which arenas do not grant yet). resolve_vmm does the
  // cuda part, once the backend knows its devices.
  VmmMode vmm_mode() const;
  // `vmm` with auto decided for `devices` devices, `vmm_supported` telling
  // whether the first can map (Runtime: before making the allocators).
  VmmMode resolve_vmm(int devices, bool vmm_supported) const;

  // True when switching from `*this` to `next` requires rebuilding the
  // allocator (possible only while nothing is allocated). vmm is left to the
  // runtime, which compares it resolved (resolve_vmm needs the backend).
  bool layout_differs(const Config& next) const;
  std::string to_json() const;
};

// Parses `text` on top of `base` into `*out`. All-or-nothing: on error
// returns false, leaves *out untouched and writes a message naming the key
// and the accepted form.
// `source` names where the text came from in an error ("PYALLOC_CONF", "pyalloc_configure").
bool parse_config(const std::string& text, const Config& base, const char* source, Config* out,
                  std::string* error);

// Parses sizes like "512", "512B", "64KiB", "1.5GiB", "2GB".
bool parse_size(const std::string& text, size_t* out);

}  // namespace pyalloc
