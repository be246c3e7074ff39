// text.cpp: see text.hpp.
#include "ground/text.hpp"

#include <cinttypes>
#include <cstdio>

namespace pyalloc {

std::string hex(uintptr_t value) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%" PRIxPTR, value);
  return buf;
}

std::string format_bytes(size_t n) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[48];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", n);
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace pyalloc
