// registry.hpp: publishing this process's record for gpumemd (Note [Registry
// publisher] in registry.cpp; the layout is pyalloc/registry.h).
#pragma once

#include <string>

#include "config.hpp"

namespace pyalloc {

// Starts or stops publishing per config.registry; sets the pressure opt-in.
void registry_apply(const Config& config);
// Asks the publisher to refresh soon (from the allocator's slow path).
void registry_poke();
// The record's path, or "" when not publishing.
std::string registry_path();

void registry_after_fork_in_child();
void registry_unlink_at_exit();

}  // namespace pyalloc
