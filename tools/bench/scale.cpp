// scale.cpp: the allocator's cost per operation against the number of live
// blocks, with and without memory pressure, through the public C ABI.
//
// A churn workload, generated here from a seed so that every policy and
// every run sees the same sequence: `live` blocks are allocated (the fill),
// then `pairs` times a live block chosen at random is freed and a new one
// allocated in its place (the churn). Sizes are log-uniform from 512 B to
// 60 MiB, scaled so that `live` blocks hold ~21 GiB on average: a model
// with 10^5 live blocks has smaller ones than a model with 10^3, as on a
// real 80 GiB device.
//
// Only the churn is measured: its wall time (ns/op), and, under callgrind,
// its instructions (the churn runs in the function scale_churn; run with
// `valgrind --tool=callgrind --toggle-collect=scale_churn`).
//
// Policies:
//   pyalloc, pyalloc-plain  this library on the sim backend (fake addresses),
//                           its defaults or plain segments (vmm=off);
//   native                  the model of PyTorch's default policy, through
//                           pyalloc_replay: the churn's cost is the
//                           difference between the whole trace and the fill
//                           alone, each timed by pyalloc_replay.
// Capacity: `factor` times the workload's peak live bytes (0: an 80 GiB
// device, no pressure).
//
// Output: one line,
//   scale: policy=P live=N ops=O ooms=X ns_per_op=T peak_live=B capacity=C reserved=R
// Usage: scale POLICY LIVE PAIRS FACTOR SEED
// Exits 0, or 1 with the reason (a failed call, a check that failed).
#include <pyalloc/pyalloc.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr uint64_t kMinSize = 512;
constexpr uint64_t kMaxSize = uint64_t{60} << 20;
constexpr double kTargetLive = 21.0 * (uint64_t{1} << 30);
constexpr uint64_t kNoLimit = uint64_t{80} << 30;

[[noreturn]] void fail(const std::string& what) {
  const char* err = pyalloc_last_error();
  std::fprintf(stderr, "scale: %s%s%s\n", what.c_str(), err && *err ? ": " : "", err ? err : "");
  std::exit(1);
}

// splitmix64: a small, seedable generator whose sequence is the same everywhere.
struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

struct Workload {
  std::vector<uint64_t> fill;         // sizes of the first `live` blocks, slot i for block i
  std::vector<uint32_t> churn_slot;   // the slot freed and allocated again, per churn pair
  std::vector<uint64_t> churn_size;   // the size of the new block
  uint64_t peak_live = 0;
};

Workload generate(size_t live, size_t pairs, uint64_t seed) {
  Rng rng{seed};
  const double lo = std::log(static_cast<double>(kMinSize));
  const double hi = std::log(static_cast<double>(kMaxSize));
  const double mean = static_cast<double>(kMaxSize - kMinSize) / (hi - lo);
  const double scale = kTargetLive / (static_cast<double>(live) * mean);
  auto draw = [&] {
    const double s = std::exp(lo + rng.uniform() * (hi - lo)) * scale;
    return std::max<uint64_t>(1, static_cast<uint64_t>(s));
  };
  Workload w;
  std::vector<uint64_t> size_of(live);
  uint64_t now = 0;
  for (size_t i = 0; i < live; ++i) {
    size_of[i] = draw();
    w.fill.push_back(size_of[i]);
    now += size_of[i];
  }
  w.peak_live = now;
  for (size_t i = 0; i < pairs; ++i) {
    const auto slot = static_cast<uint32_t>(rng.next() % live);
    const uint64_t size = draw();
    now = now - size_of[slot] + size;
    size_of[slot] = size;
    w.peak_live = std::max(w.peak_live, now);
    w.churn_slot.push_back(slot);
    w.churn_size.push_back(size);
  }
  return w;
}

struct Churn {
  std::vector<void*> addr;
  std::vector<uint64_t> size;
  uint64_t ops = 0;
  uint64_t ooms = 0;
};

// The measured loop. Not inlined, and with C linkage, so that callgrind's
// --toggle-collect=scale_churn counts exactly its instructions.
extern "C" __attribute__((noinline)) void scale_churn(const Workload* w, Churn* c) {
  const size_t n = w->churn_slot.size();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t slot = w->churn_slot[i];
    if (c->addr[slot] != nullptr) {
      pyalloc_free(c->addr[slot], c->size[slot], 0, nullptr);
      ++c->ops;
    }
    c->size[slot] = w->churn_size[i];
    c->addr[slot] = pyalloc_malloc(c->size[slot], 0, nullptr);
    ++c->ops;
    if (c->addr[slot] == nullptr) ++c->ooms;
  }
}

uint64_t reserved_bytes() {
  std::string buf(1 << 16, '\0');
  const size_t n = pyalloc_stats_json(0, buf.data(), buf.size());
  buf.resize(std::min(n, buf.size()));
  const std::string key = "\"reserved_bytes.all.current\":";
  const size_t at = buf.find(key);
  return at == std::string::npos ? 0 : std::strtoull(buf.c_str() + at + key.size(), nullptr, 10);
}

using Clock = std::chrono::steady_clock;

int run_pyalloc(const std::string& policy, const Workload& w, uint64_t capacity) {
  const std::string conf = "backend=sim,devices=1,capacity=" + std::to_string(capacity) +
                           ",trace=0,oom_report=0,registry=0" + (policy == "pyalloc-plain" ? ",vmm=off" : "");
  if (pyalloc_configure(conf.c_str()) != PYALLOC_OK) fail("pyalloc_configure(\"" + conf + "\")");
  const size_t live = w.fill.size();
  Churn c{std::vector<void*>(live, nullptr), w.fill, 0, 0};
  uint64_t fill_ooms = 0;
  for (size_t i = 0; i < live; ++i) {
    c.addr[i] = pyalloc_malloc(w.fill[i], 0, nullptr);
    if (c.addr[i] == nullptr) ++fill_ooms;
  }
  const auto start = Clock::now();
  scale_churn(&w, &c);
  const double ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
  const uint64_t reserved = reserved_bytes();
  if (pyalloc_check(0) != PYALLOC_OK) fail("pyalloc_check after the churn");
  for (size_t i = 0; i < live; ++i) {
    if (c.addr[i] != nullptr) pyalloc_free(c.addr[i], c.size[i], 0, nullptr);
  }
  std::printf("scale: policy=%s live=%zu ops=%" PRIu64 " ooms=%" PRIu64 " ns_per_op=%.2f peak_live=%" PRIu64
              " capacity=%" PRIu64 " reserved=%" PRIu64 " fill_ooms=%" PRIu64 "\n",
              policy.c_str(), live, c.ops, c.ooms, c.ops ? ns / static_cast<double>(c.ops) : 0.0, w.peak_live,
              capacity, reserved, fill_ooms);
  return 0;
}

// The native model through pyalloc_replay: the churn's time is the whole
// trace's less the fill's (each replay times every operation, clock read at
// its ends only).
int run_native(const Workload& w, uint64_t capacity) {
  const size_t live = w.fill.size();
  std::vector<unsigned char> ops;
  std::vector<uint32_t> slots;
  std::vector<uint64_t> sizes, streams;
  std::vector<uint64_t> size_of(w.fill);
  for (size_t i = 0; i < live; ++i) {
    ops.push_back(0);
    slots.push_back(static_cast<uint32_t>(i));
    sizes.push_back(w.fill[i]);
  }
  const size_t fill_events = ops.size();
  for (size_t i = 0; i < w.churn_slot.size(); ++i) {
    const uint32_t slot = w.churn_slot[i];
    ops.push_back(1);
    slots.push_back(slot);
    sizes.push_back(size_of[slot]);
    size_of[slot] = w.churn_size[i];
    ops.push_back(0);
    slots.push_back(slot);
    sizes.push_back(size_of[slot]);
  }
  streams.assign(ops.size(), 0);
  pyalloc_replay_result fill{}, whole{};
  if (pyalloc_replay("native", capacity, ops.data(), slots.data(), sizes.data(), streams.data(), fill_events, live,
                     nullptr, nullptr, 0, &fill) != PYALLOC_OK ||
      pyalloc_replay("native", capacity, ops.data(), slots.data(), sizes.data(), streams.data(), ops.size(), live,
                     nullptr, nullptr, 0, &whole) != PYALLOC_OK) {
    fail("pyalloc_replay(native)");
  }
  const double churn_ns = whole.ns_per_op * static_cast<double>(whole.ops) -
                          fill.ns_per_op * static_cast<double>(fill.ops);
  const uint64_t churn_ops = whole.ops - fill.ops;
  std::printf("scale: policy=native live=%zu ops=%" PRIu64 " ooms=%" PRIu64 " ns_per_op=%.2f peak_live=%" PRIu64
              " capacity=%" PRIu64 " reserved=%" PRIu64 " fill_ooms=%" PRIu64 "\n",
              live, churn_ops, whole.ooms - fill.ooms, churn_ops ? churn_ns / static_cast<double>(churn_ops) : 0.0,
              w.peak_live, capacity, whole.peak_reserved_bytes, fill.ooms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: scale pyalloc|pyalloc-plain|native LIVE PAIRS FACTOR SEED\n");
    return 2;
  }
  const std::string policy = argv[1];
  const size_t live = std::strtoull(argv[2], nullptr, 10);
  const size_t pairs = std::strtoull(argv[3], nullptr, 10);
  const double factor = std::strtod(argv[4], nullptr);
  const uint64_t seed = std::strtoull(argv[5], nullptr, 10);
  if (live == 0 || live > (size_t{1} << 31) || factor < 0) {
    std::fprintf(stderr, "scale: LIVE must be 1 to 2^31 and FACTOR >= 0 (0: no limit)\n");
    return 2;
  }
  const Workload w = generate(live, pairs, seed);
  const uint64_t capacity =
      factor == 0 ? kNoLimit : static_cast<uint64_t>(std::ceil(factor * static_cast<double>(w.peak_live)));
  if (policy == "native") return run_native(w, capacity);
  if (policy == "pyalloc" || policy == "pyalloc-plain") return run_pyalloc(policy, w, capacity);
  std::fprintf(stderr, "scale: unknown policy '%s' (pyalloc, pyalloc-plain or native)\n", policy.c_str());
  return 2;
}
