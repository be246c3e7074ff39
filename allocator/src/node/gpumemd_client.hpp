// gpumemd_client.hpp: step 4 of the pressure ladder, asking the node daemon.
#pragma once

#include <cstddef>
#include <string>

namespace pyalloc {

// Asks gpumemd, over its Unix socket, to have other opted-in pyalloc
// processes on `device` trim their caches by `bytes`. `socket_path` is a
// path, or "auto" for gpumemd's default (/run/gpumemd.sock as root, else
// $XDG_RUNTIME_DIR/gpumemd.sock or /tmp/gpumemd-<uid>/gpumemd.sock). Never
// blocks for more than a few seconds. True when gpumemd answered, with the
// bytes the others freed in *freed_bytes; an absent or silent daemon is "not
// answered" (false, 0 bytes).
bool ask_gpumemd(const std::string& socket_path, int device, size_t bytes, size_t* freed_bytes);

}  // namespace pyalloc
