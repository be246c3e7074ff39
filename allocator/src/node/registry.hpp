// registry.hpp: publishing this process's record for gpumemd (Note [Registry
// publisher] in registry.cpp; the layout is pyalloc/registry.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ground/config.hpp"
#include "pyalloc/registry.h"

namespace pyalloc {

// What the publisher reads and serves. The process's runtime provides it
// (abi/runtime.cpp): the publisher knows no allocator, only these figures.
// Called from the publisher's thread, never with the publisher's lock held.
class RegistrySource {
 public:
  virtual ~RegistrySource() = default;
  virtual const char* backend_name() = 0;
  // Fills devices[0, n) (all fields but last_alloc_unix_ns) and
  // allocations_total[0, n) (a count that changes whenever the device
  // allocates); returns n <= max.
  virtual size_t read_devices(pyalloc_registry_device* devices, uint64_t* allocations_total, size_t max) = 0;
  // A trim request from the mailbox: releases up to `bytes` (0: all) of the
  // cached memory of `device`, or of every device when it is -1; returns the
  // bytes released.
  virtual size_t trim(int device, size_t bytes) = 0;
};

// Starts or stops publishing per config.registry, reading `source` (which
// must outlive the process); sets the pressure opt-in.
void registry_apply(const Config& config, RegistrySource* source);
// Asks the publisher to refresh soon (from the allocator's slow path).
void registry_poke();
// The record's path, or "" when not publishing.
std::string registry_path();

void registry_after_fork_in_child();
void registry_unlink_at_exit();

}  // namespace pyalloc
