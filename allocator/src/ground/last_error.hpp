// last_error.hpp: the thread's message for pyalloc_last_error().
//
// Any layer that refuses a call or fails a request leaves its reason here;
// the C entry points (abi/capi.cpp) hand it out. Thread-local, so one
// thread's failure never overwrites another's message.
#pragma once

#include <string>

namespace pyalloc {

void set_last_error(std::string message);
std::string& last_error_slot();

}  // namespace pyalloc
