// last_error.cpp: see last_error.hpp.
#include "ground/last_error.hpp"

namespace pyalloc {

namespace {
thread_local std::string t_last_error;
}  // namespace

std::string& last_error_slot() { return t_last_error; }
void set_last_error(std::string message) { t_last_error = std::move(message); }

}  // namespace pyalloc
