// text.hpp: numbers as the allocator's messages write them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyalloc {

// "0x7f3a00000000"
std::string hex(uintptr_t value);
// "512 B", "2.50 KiB", "1.00 GiB": two decimals from KiB up.
std::string format_bytes(size_t n);

}  // namespace pyalloc
