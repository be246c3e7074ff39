// ipc.cpp: sharing a live block with another process.
//
// Note [Sharing blocks]
// torch.multiprocessing (DataLoader workers, a producer and its consumers)
// passes a CUDA tensor to another process as a handle to its memory, which
// the other process maps; the producer keeps the tensor alive until every
// consumer is done (PyTorch's reference counter file), so the block stays
// allocated while it is shared.
//   - A block of a plain segment is shared as its whole segment (the backend
//     exports the allocation: cuIpcGetMemHandle on cuda) and the block's
//     offset in it, as PyTorch's own allocator shares its cudaMalloc blocks.
//   - A block of an arena is shared as the physical chunks it lies on
//     (granules and extents, Note [Extents] in device/chunks.cpp), each
//     exported by the backend (a POSIX file descriptor on cuda, the memfd on
//     the host backend: the importer takes it with pidfd_getfd), with its
//     size, and the block's offset in the first. cudaIpcGetMemHandle refuses
//     virtual-memory mappings; this is how they travel. The importer
//     reserves an address range and maps the chunks in order, so it sees
//     the block contiguous, as the exporter does. Neighbours that share a
//     chunk with the block are visible to the importer too, as a plain
//     segment's neighbours are.
// The handle is self-describing bytes ("pyalloc-ipc", a version, the kind,
// the sizes, then each part as the backend wrote it); the importer refuses
// anything else by name. An import is undone by ipc_close, which unmaps and
// drops the importer's references; the exporter's memory is its own.
#include <cstring>

#include "device/device_allocator.hpp"

namespace pyalloc {

namespace {

constexpr char kMagic[12] = "pyalloc-ipc";
constexpr uint8_t kVersion = 2;  // 2: each chunk's size travels with it (extents)
constexpr uint8_t kPlain = 'S';
constexpr uint8_t kGranules = 'G';

// 40 bytes, no padding; then each part: for kGranules its mapped size
// (uint64), then its length (uint32) and its bytes.
struct Header {
  char magic[12];
  uint8_t version;
  uint8_t kind;
  uint8_t reserved[2];
  uint32_t parts;
  uint32_t reserved2;
  uint64_t size;     // the bytes the importer maps
  uint64_t granule;  // kGranules: the exporter's granule, which every part's size is a multiple of
};
static_assert(sizeof(Header) == 40, "the handle's header has no padding");

template <typename T>
void put_raw(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Reads a T at *at of `in`, moving *at past it; false when `in` ends first.
template <typename T>
bool read_raw(const std::string& in, size_t* at, T* v) {
  if (in.size() - *at < sizeof *v) return false;
  std::memcpy(v, in.data() + *at, sizeof *v);
  *at += sizeof *v;
  return true;
}

}  // namespace

bool DeviceAllocator::ipc_export(uintptr_t addr, std::string* handle, size_t* offset, std::string* error) {
  Lock lock(mutex_);
  auto* entry = live_.find(addr);
  if (entry == nullptr) return false;  // another device's, perhaps: *error stays empty
  const Block* block = entry->value;
  const Segment* seg = block->segment;
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  std::vector<std::string> parts;
  std::vector<uint64_t> sizes;  // kGranules: each part's mapped size
  if (!seg->arena) {
    std::string part;
    if (!succeeded(backend_->segment_export(device_, seg->base, seg->size, &part))) {
      *error = last_backend_error_;
      return false;
    }
    parts.push_back(std::move(part));
    h.kind = kPlain;
    h.size = seg->size;
    *offset = addr - seg->base;
  } else {
    // The chunks under the block, whole: from the start of the one that
    // holds its first byte.
    const size_t g = granule_;
    const size_t first = extent_start(seg, (addr - seg->base) / g, g);
    const size_t last = (addr + block->size - 1 - seg->base) / g;
    for (size_t slot = first; slot <= last; slot += seg->phys[slot].size / g) {
      std::string part;
      if (!succeeded(backend_->phys_export(device_, seg->phys[slot], &part))) {
        *error = last_backend_error_;
        return false;
      }
      parts.push_back(std::move(part));
      sizes.push_back(seg->phys[slot].size);
      h.size += seg->phys[slot].size;
    }
    h.kind = kGranules;
    h.granule = g;
    *offset = addr - (seg->base + first * g);
  }
  if (seg->arena) {  // its granules are the importers' too: never moved (Note [Moving slivers])
    if (exported_.size() >= 256) prune_exported();
    exported_.insert(addr);
  }
  h.parts = static_cast<uint32_t>(parts.size());
  handle->assign(reinterpret_cast<const char*>(&h), sizeof h);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!sizes.empty()) put_raw(handle, sizes[i]);
    put_raw(handle, static_cast<uint32_t>(parts[i].size()));
    handle->append(parts[i]);
  }
  return true;
}

bool DeviceAllocator::ipc_import(const std::string& handle, uintptr_t* base, std::string* error) {
  Header h{};
  if (handle.size() < sizeof h || std::memcmp(handle.data(), kMagic, sizeof kMagic) != 0) {
    *error = "not a pyalloc IPC handle (" + std::to_string(handle.size()) + " bytes)";
    return false;
  }
  std::memcpy(&h, handle.data(), sizeof h);
  if (h.version != kVersion || (h.kind != kPlain && h.kind != kGranules)) {
    *error = "a pyalloc IPC handle of version " + std::to_string(h.version) + ", kind " + std::to_string(h.kind) +
             " (this pyalloc reads version " + std::to_string(kVersion) + ")";
    return false;
  }
  const bool plain = h.kind == kPlain;
  std::vector<std::string> parts;
  std::vector<uint64_t> sizes;
  uint64_t total = 0;
  bool sizes_whole = true;  // every part a whole number of granules
  size_t at = sizeof h;
  for (uint32_t i = 0; i < h.parts; ++i) {
    uint64_t size = 0;
    uint32_t n = 0;
    if ((!plain && !read_raw(handle, &at, &size)) || !read_raw(handle, &at, &n) || handle.size() - at < n) break;
    // Parts that add up to more than the header's size, or a chunk larger
    // than any extent, would map past the reservation: refused (total never
    // passes h.size, so the subtraction cannot wrap).
    if (!plain && (size > kMaxExtent || size > h.size - total)) break;
    parts.emplace_back(handle, at, n);
    at += n;
    sizes.push_back(size);
    total += size;
    sizes_whole = sizes_whole && size != 0 && h.granule != 0 && size % h.granule == 0;
  }
  if (parts.size() != h.parts || at != handle.size() || (plain && h.parts != 1) ||
      (!plain && (h.parts == 0 || !sizes_whole || h.size != total))) {
    *error = "a truncated or malformed pyalloc IPC handle";
    return false;
  }

  Lock lock(mutex_);
  Import imported;
  imported.size = h.size;
  if (plain) {
    size_t size = h.size;
    if (!succeeded(backend_->segment_import(device_, parts[0], base, &size))) {
      *error = last_backend_error_;
      return false;
    }
    imported.size = size;
  } else {
    if (!succeeded(backend_->reserve(device_, h.size, base))) {
      *error = last_backend_error_;
      return false;
    }
    // Every chunk imported, then mapped end to end in one call, all or none.
    bool ok = true;
    for (size_t i = 0; i < parts.size() && ok; ++i) {
      PhysHandle chunk;
      ok = succeeded(backend_->phys_import(device_, parts[i], sizes[i], &chunk));
      if (ok) imported.chunks.push_back(chunk);
    }
    ok = ok && succeeded(backend_->map_range(device_, *base, imported.chunks.data(), imported.chunks.size()));
    if (!ok) {
      *error = last_backend_error_;
      for (const PhysHandle& chunk : imported.chunks) backend_->phys_close(device_, chunk);
      backend_->release_reservation(device_, *base, h.size);
      return false;
    }
  }
  // The driver maps a handle once per process: an import of one already
  // mapped here answers the same address, and is counted (ipc_close).
  const auto [it, fresh] = imports_.emplace(*base, std::move(imported));
  if (!fresh) ++it->second.refs;
  return true;
}

bool DeviceAllocator::ipc_close(uintptr_t base) {
  Lock lock(mutex_);
  const auto it = imports_.find(base);
  if (it == imports_.end() || it->second.refs == 0) return false;
  if (--it->second.refs > 0) return true;
  if (capturing_ > 0) {  // unmapping synchronizes: at the capture's end (Note [Capture])
    closing_.push_back(base);
    return true;
  }
  unmap_import(base);
  return true;
}

void DeviceAllocator::unmap_import(uintptr_t base) {
  const auto it = imports_.find(base);
  if (it->second.chunks.empty()) {
    backend_->segment_close(device_, base, it->second.size);
  } else {
    close_import_chunks(base, it->second);
  }
  imports_.erase(it);
}

// Unmaps and closes the chunks of an import mapped at `base`
// (one unmap_range: on cuda, one wait for the device), and gives back its
// reservation (`imported.size` bytes).
void DeviceAllocator::close_import_chunks(uintptr_t base, const Import& imported) {
  const size_t n = imported.chunks.size();
  if (n > 0) backend_->unmap_range(device_, base, imported.chunks.data(), n);
  for (const PhysHandle& chunk : imported.chunks) backend_->phys_close(device_, chunk);
  backend_->release_reservation(device_, base, imported.size);
}

}  // namespace pyalloc
