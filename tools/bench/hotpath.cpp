// hotpath.cpp: the allocator's hot path, measured through the public C ABI only.
//
// Three loops, each a number of malloc+free pairs on the sim backend (fake
// addresses: no memory is touched, so what is measured is the allocator):
//
//   hit     exact reuse. Three blocks A, B, C of 256 KiB are carved from one
//           2 MiB small-pool segment (hit-shared: the arena's first
//           granule) and B is freed, so the free block has
//           allocated neighbours on both sides. Then N times malloc+free of
//           256 KiB: best fit finds B exactly, with no split and no merge.
//           This is the path a training loop takes once warmed up.
//   split   split and merge. A 2 MiB keeper is carved from a 20 MiB
//           segment, leaving an 18 MiB free block after it. Then N times
//           malloc+free of 4 MiB: the malloc splits the 18 MiB block (the
//           14 MiB remainder is worth keeping), the free merges it back.
//   replay  a recorded trace (the text format below, written by hotpath.py)
//           replayed N times through pyalloc_malloc / pyalloc_free; what a
//           repetition leaves live is freed at its end, so every allocation
//           is one pair.
//
// Each mode runs with plain segments (vmm=off, what the cuda backend has
// today); with the suffix `-shared` (hit-shared, replay-shared) it runs with
// one arena for small and large requests (vmm=shared, the host and sim
// default; Note [One arena for small and large]).
//
// Output: one line, `hotpath: mode=M pairs=P ns_per_pair=X`. hotpath.py runs
// this under callgrind with two values of N and divides the difference in
// instructions by the difference in pairs, so start-up (loading, configuring,
// reading the trace) cancels out.
//
// Trace text format (replay):
//   pyalloc-hotpath-trace 1
//   <events> <slots>
//   a <slot> <size> <stream>      one line per allocation
//   f <slot> <size> <stream>      one line per free
//
// Usage: hotpath hit|split|hit-shared N  |  hotpath replay|replay-shared N FILE
// Exits 0, or 1 with the reason (a failed call, a cache hit that was not one).
#include <pyalloc/pyalloc.h>

#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t KiB = size_t{1} << 10;
constexpr size_t MiB = size_t{1} << 20;
constexpr const char* kConf = "backend=sim,devices=1,capacity=80GiB,trace=0,oom_report=0,registry=0";

[[noreturn]] void fail(const std::string& what) {
  const char* err = pyalloc_last_error();
  std::fprintf(stderr, "hotpath: %s%s%s\n", what.c_str(), err && *err ? ": " : "", err ? err : "");
  std::exit(1);
}

void* must_malloc(size_t size) {
  void* p = pyalloc_malloc(size, 0, nullptr);
  if (p == nullptr) fail("pyalloc_malloc(" + std::to_string(size) + ") failed");
  return p;
}

using Clock = std::chrono::steady_clock;

double elapsed_ns(Clock::time_point start) {
  return std::chrono::duration<double, std::nano>(Clock::now() - start).count();
}

// Mode hit: exact reuse of a free block between two allocated ones.
double run_hit(uint64_t n) {
  const size_t size = 256 * KiB;
  void* a = must_malloc(size);
  void* b = must_malloc(size);
  void* c = must_malloc(size);
  pyalloc_free(b, size, 0, nullptr);
  const auto start = Clock::now();
  for (uint64_t i = 0; i < n; ++i) {
    void* p = pyalloc_malloc(size, 0, nullptr);
    if (p != b) fail("hit: malloc did not reuse the freed block exactly");
    pyalloc_free(p, size, 0, nullptr);
  }
  const double ns = elapsed_ns(start);
  pyalloc_free(a, size, 0, nullptr);
  pyalloc_free(c, size, 0, nullptr);
  return ns;
}

// Mode split: carve 4 MiB from an 18 MiB free block and merge it back.
double run_split(uint64_t n) {
  const size_t keeper_size = 2 * MiB;
  const size_t size = 4 * MiB;
  char* keeper = static_cast<char*>(must_malloc(keeper_size));
  const auto start = Clock::now();
  for (uint64_t i = 0; i < n; ++i) {
    void* p = pyalloc_malloc(size, 0, nullptr);
    if (p != keeper + keeper_size) fail("split: malloc did not carve the free block after the keeper");
    pyalloc_free(p, size, 0, nullptr);
  }
  const double ns = elapsed_ns(start);
  pyalloc_free(keeper, keeper_size, 0, nullptr);
  return ns;
}

struct Event {
  bool alloc;
  uint32_t slot;
  uint64_t size;
  uint64_t stream;
};

std::vector<Event> read_trace(const char* path, size_t* n_slots) {
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) fail(std::string("cannot open ") + path);
  char magic[64] = {0};
  int version = 0;
  size_t n = 0;
  if (std::fscanf(f, "%63s %d %zu %zu", magic, &version, &n, n_slots) != 4 ||
      std::strcmp(magic, "pyalloc-hotpath-trace") != 0 || version != 1) {
    fail(std::string(path) + ": not a pyalloc-hotpath-trace 1 file");
  }
  std::vector<Event> events;
  events.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    char op[4] = {0};
    uint32_t slot = 0;
    uint64_t size = 0, stream = 0;
    if (std::fscanf(f, "%3s %" SCNu32 " %" SCNu64 " %" SCNu64, op, &slot, &size, &stream) != 4 ||
        (op[0] != 'a' && op[0] != 'f') || slot >= *n_slots) {
      fail(std::string(path) + ": bad event " + std::to_string(i));
    }
    events.push_back({op[0] == 'a', slot, size, stream});
  }
  std::fclose(f);
  return events;
}

// Mode replay: the trace n times. Returns ns; *pairs gets the allocations made.
double run_replay(uint64_t n, const char* path, uint64_t* pairs) {
  size_t n_slots = 0;
  const std::vector<Event> events = read_trace(path, &n_slots);
  std::vector<void*> addr(n_slots, nullptr);
  std::vector<uint64_t> size_of(n_slots, 0);
  *pairs = 0;
  const auto start = Clock::now();
  for (uint64_t rep = 0; rep < n; ++rep) {
    for (const Event& e : events) {
      void* stream = reinterpret_cast<void*>(e.stream);
      if (e.alloc) {
        addr[e.slot] = pyalloc_malloc(e.size, 0, stream);
        if (addr[e.slot] == nullptr) fail("replay: pyalloc_malloc failed");
        size_of[e.slot] = e.size;
        ++*pairs;
      } else {
        pyalloc_free(addr[e.slot], e.size, 0, PYALLOC_ANY_STREAM);  // a trace's free may name another stream
        addr[e.slot] = nullptr;
      }
    }
    for (size_t s = 0; s < n_slots; ++s) {
      if (addr[s] != nullptr) {
        pyalloc_free(addr[s], size_of[s], 0, nullptr);
        addr[s] = nullptr;
      }
    }
  }
  return elapsed_ns(start);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: hotpath hit|split|hit-shared N | hotpath replay|replay-shared N FILE\n");
    return 2;
  }
  std::string mode = argv[1];
  const uint64_t n = std::strtoull(argv[2], nullptr, 10);
  const size_t suffix = mode.rfind("-shared");
  const bool shared = suffix != std::string::npos && suffix + 7 == mode.size();
  if (shared) mode.resize(suffix);
  if (pyalloc_configure(kConf) != PYALLOC_OK) fail(std::string("pyalloc_configure(\"") + kConf + "\")");
  // Plain segments unless asked, so that `split` splits and merges: in an
  // arena the 4 MiB block would be mapped to its exact size and every pair
  // would be a hit. A library older than the vmm key refuses it and has plain
  // segments anyway.
  if (shared) {
    if (pyalloc_configure("vmm=shared") != PYALLOC_OK) fail("pyalloc_configure(\"vmm=shared\")");
  } else {
    pyalloc_configure("vmm=off");
  }
  // The cache path, not an iteration plan: a repeated pair is a period the
  // planner would learn (Note [Iteration plans]). Older libraries refuse the key.
  pyalloc_configure("plan=0,lifetime=0");
  uint64_t pairs = n;
  double ns = 0;
  if (mode == "hit") {
    ns = run_hit(n);
  } else if (mode == "split" && !shared) {
    ns = run_split(n);
  } else if (mode == "replay" && argc >= 4) {
    ns = run_replay(n, argv[3], &pairs);
  } else {
    std::fprintf(stderr, "hotpath: unknown mode '%s' (hit, split, hit-shared, or replay|replay-shared N FILE)\n",
                 argv[1]);
    return 2;
  }
  if (pyalloc_check(0) != PYALLOC_OK) fail("pyalloc_check after the loop");
  std::printf("hotpath: mode=%s pairs=%" PRIu64 " ns_per_pair=%.2f\n", argv[1], pairs,
              pairs ? ns / static_cast<double>(pairs) : 0.0);
  return 0;
}
