// config.cpp: parsing and validation of PYALLOC_CONF.
#include "ground/config.hpp"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <vector>

#include "ground/json.hpp"

namespace pyalloc {

namespace {

constexpr size_t kMinSegment = 512;
constexpr size_t kMaxTraceEntries = size_t{1} << 24;
constexpr int kMaxDevices = 64;
constexpr int kMaxEventDelay = 1000000;

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool parse_int(const std::string& text, long long lo, long long hi, long long* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_bool(const std::string& text, bool* out) {
  const std::string t = lower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") return *out = true, true;
  if (t == "0" || t == "false" || t == "off" || t == "no") return *out = false, true;
  return false;
}

// One entry per key: the single documented table of PYALLOC_CONF.
struct KeySpec {
  const char* key;
  const char* form;  // the accepted form, quoted in errors
  std::function<bool(const std::string& value, Config* cfg)> apply;
};

const std::vector<KeySpec>& key_specs() {
  static const std::vector<KeySpec>* specs = new std::vector<KeySpec>{
      {"backend", "one of cuda, host, sim",
       [](const std::string& v, Config* c) {
         const std::string t = lower(v);
         if (t == "cuda") c->backend = BackendKind::kCuda;
         else if (t == "host") c->backend = BackendKind::kHost;
         else if (t == "sim") c->backend = BackendKind::kSim;
         else return false;
         return true;
       }},
      {"devices", "an integer from 1 to 64 (host and sim backends)",
       [](const std::string& v, Config* c) {
         long long n;
         if (!parse_int(v, 1, kMaxDevices, &n)) return false;
         c->devices = static_cast<int>(n);
         return true;
       }},
      // At most 1 TiB: an arena keeps metadata per granule of 8x the device (1 TiB: ~128 MiB of
      // host memory; 512 TiB ran the host out of it), and the sim backend's devices lie 4 PiB
      // apart (above that, two devices handed out the same addresses).
      {"capacity", "a size such as 8GiB, at most 1TiB (host and sim backends; 0 = backend default)",
       [](const std::string& v, Config* c) {
         size_t s;
         if (!parse_size(v, &s) || s > (size_t{1} << 40)) return false;
         c->capacity = s;
         return true;
       }},
      {"memory_fraction", "a number in (0, 1]",
       [](const std::string& v, Config* c) {
         char* end = nullptr;
         double f = std::strtod(v.c_str(), &end);
         if (v.empty() || end != v.c_str() + v.size() || !(f > 0.0 && f <= 1.0)) return false;
         c->memory_fraction = f;
         return true;
       }},
      {"max_cached", "a size such as 4GiB, or unlimited",
       [](const std::string& v, Config* c) {
         if (lower(v) == "unlimited") return c->max_cached = SIZE_MAX, true;
         return parse_size(v, &c->max_cached);
       }},
      {"small_segment", "a size, a multiple of 512 B, at least 1MiB",
       [](const std::string& v, Config* c) {
         size_t s;
         if (!parse_size(v, &s) || s % kMinSegment != 0 || s < (size_t{1} << 20)) return false;
         c->small_segment = s;
         return true;
       }},
      {"large_segment", "a size, a multiple of 512 B, at least 2MiB",
       [](const std::string& v, Config* c) {
         size_t s;
         if (!parse_size(v, &s) || s % kMinSegment != 0 || s < (size_t{2} << 20)) return false;
         c->large_segment = s;
         return true;
       }},
      {"round_power2", "0 (off) or a power of two from 1 to 64: divisions per power-of-two interval",
       [](const std::string& v, Config* c) {
         long long n;
         if (!parse_int(v, 0, 64, &n) || (n & (n - 1)) != 0) return false;
         c->round_power2 = static_cast<int>(n);
         return true;
       }},
      {"trace", "an integer: trace ring entries, 0 (off) to 16777216",
       [](const std::string& v, Config* c) {
         long long n;
         if (!parse_int(v, 0, static_cast<long long>(kMaxTraceEntries), &n)) return false;
         c->trace = static_cast<size_t>(n);
         return true;
       }},
      {"event_delay", "an integer from 0 to 1000000 (host backend)",
       [](const std::string& v, Config* c) {
         long long n;
         if (!parse_int(v, 0, kMaxEventDelay, &n)) return false;
         c->event_delay = static_cast<int>(n);
         return true;
       }},
      {"oom_report", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->oom_report); }},
      {"registry", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->registry); }},
      {"pressure_opt_in", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->pressure_opt_in); }},
      {"daemon_socket", "auto, off, or an absolute path to gpumemd's Unix socket (no commas)",
       [](const std::string& v, Config* c) {
         if (v != "auto" && v != "off" && (v.empty() || v[0] != '/' || v.size() >= 108)) return false;
         c->daemon_socket = v;
         return true;
       }},
      {"vmm", "auto, on, shared, all or off (auto: shared for the host and sim backends, off for cuda)",
       [](const std::string& v, Config* c) {
         const std::string t = lower(v);
         bool on = false;
         if (t == "auto") c->vmm = VmmMode::kAuto;
         else if (t == "shared") c->vmm = VmmMode::kShared;
         else if (t == "all") c->vmm = VmmMode::kAll;
         else if (parse_bool(t, &on)) c->vmm = on ? VmmMode::kOn : VmmMode::kOff;
         else return false;
         return true;
       }},
      {"plan", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->plan); }},
      {"lifetime", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->lifetime); }},
      {"share", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->share); }},
      {"move", "0, 1 or auto (auto: 1 but for the host backend)",
       [](const std::string& v, Config* c) {
         if (lower(v) == "auto") return c->move = -1, true;
         bool on;
         if (!parse_bool(v, &on)) return false;
         c->move = on ? 1 : 0;
         return true;
       }},
      {"reuse", "0 or 1",
       [](const std::string& v, Config* c) { return parse_bool(v, &c->reuse); }},
      {"extent", "a power of two from 2MiB to 1GiB (2MiB: every granule its own chunk)",
       [](const std::string& v, Config* c) {
         size_t s;
         if (!parse_size(v, &s) || s < kMinExtent || s > kMaxExtent || (s & (s - 1)) != 0) return false;
         c->extent = s;
         return true;
       }},
  };
  return *specs;
}

}  // namespace

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCuda: return "cuda";
    case BackendKind::kHost: return "host";
    case BackendKind::kSim: return "sim";
  }
  return "?";
}

// Sizes from this one up are refused (no device is near it; pyalloc/sizes.py's MAX_SIZE).
constexpr uint64_t kMaxSize = 9'000'000'000'000'000'000ull;

bool parse_size(const std::string& raw, size_t* out) {
  const std::string text = trim(raw);
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i);
  const std::string unit = lower(trim(text.substr(i)));
  if (number.empty() || number == "." ) return false;
  uint64_t multiplier;
  if (unit.empty() || unit == "b") multiplier = 1;
  else if (unit == "kib" || unit == "k") multiplier = uint64_t{1} << 10;
  else if (unit == "mib" || unit == "m") multiplier = uint64_t{1} << 20;
  else if (unit == "gib" || unit == "g") multiplier = uint64_t{1} << 30;
  else if (unit == "tib" || unit == "t") multiplier = uint64_t{1} << 40;
  else if (unit == "kb") multiplier = 1000;
  else if (unit == "mb") multiplier = 1000 * 1000;
  else if (unit == "gb") multiplier = 1000 * 1000 * 1000;
  else if (unit == "tb") multiplier = uint64_t{1000} * 1000 * 1000 * 1000;
  else return false;
  if (number.find('.') == std::string::npos) {  // a whole number: exact, not through a double
    uint64_t n = 0;
    for (const char c : number) {
      const uint64_t digit = static_cast<uint64_t>(c - '0');
      if (n > (kMaxSize - digit) / 10) return false;
      n = n * 10 + digit;
    }
    if (n != 0 && multiplier > (kMaxSize - 1) / n) return false;
    *out = static_cast<size_t>(n * multiplier);
    return true;
  }
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end) * static_cast<double>(multiplier);
  if (end != number.c_str() + number.size() || !std::isfinite(value) || value < 0 ||
      value >= static_cast<double>(kMaxSize) || value != std::floor(value)) {
    return false;
  }
  *out = static_cast<size_t>(value);
  return true;
}

bool parse_config(const std::string& text, const Config& base, const char* source, Config* out,
                  std::string* error) {
  Config next = base;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) {
      *error = std::string(source) + ": '" + item + "' is not key=value";
      return false;
    }
    const std::string key = lower(trim(item.substr(0, eq)));
    const std::string value = trim(item.substr(eq + 1));
    const KeySpec* spec = nullptr;
    for (const KeySpec& s : key_specs()) {
      if (key == s.key) spec = &s;
    }
    if (spec == nullptr) {
      std::string known;
      for (const KeySpec& s : key_specs()) known += (known.empty() ? "" : ", ") + std::string(s.key);
      *error = std::string(source) + ": unknown key '" + key + "' (known keys: " + known + ")";
      return false;
    }
    if (!spec->apply(value, &next)) {
      *error = std::string(source) + ": bad value '" + value + "' for " + key + ": expected " + spec->form;
      return false;
    }
  }
  if (next.large_segment < next.small_segment) {
    *error = std::string(source) + ": large_segment must be at least small_segment";
    return false;
  }
  if (next.capacity != 0 && next.capacity < kMinCapacity) {
    *error = std::string(source) + ": capacity " + std::to_string(next.capacity) +
             " bytes is less than one 2 MiB granule: every allocation would fail (0 is the backend's default)";
    return false;
  }
  // Each device has a ring of its own: together they must fit in memory.
  const size_t rings = next.backend == BackendKind::kCuda ? 1 : static_cast<size_t>(next.devices);
  if (next.trace > kMaxTraceBytes / kTraceEventBytes / rings) {
    *error = std::string(source) + ": trace=" + std::to_string(next.trace) + " on " + std::to_string(rings) +
             " devices needs " + std::to_string(next.trace * rings * kTraceEventBytes >> 20) +
             " MiB of trace rings; at most " + std::to_string(kMaxTraceBytes >> 20) + " MiB (lower trace or devices)";
    return false;
  }
  *out = next;
  return true;
}

VmmMode Config::vmm_mode() const {
  if (vmm == VmmMode::kAuto) return backend == BackendKind::kCuda ? VmmMode::kOff : VmmMode::kShared;
  return vmm;
}

VmmMode Config::resolve_vmm(int devices, bool vmm_supported) const {
  if (vmm != VmmMode::kAuto || backend != BackendKind::kCuda) return vmm_mode();
  return devices == 1 && vmm_supported ? VmmMode::kShared : VmmMode::kOff;
}

bool Config::layout_differs(const Config& n) const {
  return backend != n.backend || devices != n.devices || capacity != n.capacity ||
         small_segment != n.small_segment || large_segment != n.large_segment ||
         event_delay != n.event_delay || plan != n.plan || lifetime != n.lifetime;
}

std::string Config::to_json() const {
  JsonWriter w;
  w.begin_object();
  w.key("backend").value(backend_name(backend));
  w.key("devices").value(static_cast<int64_t>(devices));
  w.key("capacity").value(static_cast<uint64_t>(capacity));
  w.key("memory_fraction").value(memory_fraction);
  if (max_cached == SIZE_MAX) w.key("max_cached").value("unlimited");
  else w.key("max_cached").value(static_cast<uint64_t>(max_cached));
  w.key("small_segment").value(static_cast<uint64_t>(small_segment));
  w.key("large_segment").value(static_cast<uint64_t>(large_segment));
  w.key("round_power2").value(static_cast<int64_t>(round_power2));
  w.key("trace").value(static_cast<uint64_t>(trace));
  w.key("event_delay").value(static_cast<int64_t>(event_delay));
  w.key("oom_report").value(oom_report);
  w.key("registry").value(registry);
  w.key("pressure_opt_in").value(pressure_opt_in);
  w.key("daemon_socket").value(daemon_socket);
  static const char* const vmm_names[] = {"auto", "on", "shared", "all", "off"};
  w.key("vmm").value(vmm_names[static_cast<int>(vmm)]);
  w.key("plan").value(plan);
  w.key("lifetime").value(lifetime);
  w.key("share").value(share);
  if (move < 0) w.key("move").value("auto");
  else w.key("move").value(move != 0);
  w.key("extent").value(static_cast<uint64_t>(extent));
  w.key("reuse").value(reuse);
  w.end_object();
  return w.str();
}

}  // namespace pyalloc
