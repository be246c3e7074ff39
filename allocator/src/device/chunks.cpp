// chunks.cpp: an arena's physical memory: chunks created from the backend,
// mapped into a window's holes, unmapped from free blocks and given back
// (Note [Extents]). Where an arena grows and what moves is arena.cpp's.
//
// Note [Extents]
// On a GPU an arena's growth costs per mapping, not per byte. Measured on an
// H200 (tools/bench/vmm_calls.py, docs/benchmarks/2026-11-27-gpu-check-h200-run3):
// cuMemCreate 17-19 us whatever the size, cuMemMap 4-5 us, cuMemSetAccess
// 37 us over one mapping of 32 MiB and 645 us over sixteen mappings of 2 MiB
// (40 us a mapping), cuMemUnmap 26 us and cuMemRelease 17-35 us a mapping.
// With a handle per granule, filling 60% of the device took 2.56 s (42,789
// granules) where expandable_segments' 20 MiB pages took 0.28 s. The driver
// maps a handle only whole and from its start (cuMemMap at an offset:
// CUDA_ERROR_NOT_SUPPORTED), and unmaps a mapping only whole, so fewer
// mappings means larger chunks that move and go back only whole.
// So a growth creates its new memory hole by hole of its window (map_window):
// the granules that the request lies over wholly in extents, one handle
// mapped once each; the others (the request's partly used first and last
// granule) as granules of their own. Extents are cut where a hole or the
// request's whole granules end, so a chunk may be any number of granules up
// to the cap. The partly used granules, where slivers
// lie and shared granules map a second time (Note [Shared granules]: only a
// chunk of one granule can be a twin), stay single.
// A block freed gives back its extents whole, as it lies over all of them.
// What cannot go back is an extent that a later, smaller request split, while
// that request lives: memory stitching cannot move. So an extent is the
// largest power of two of granules that is at most 1/kExtentShare (1/16) of
// its request, and at most `extent` bytes (PYALLOC_CONF, a power of two; 32
// MiB by default; extent=2MiB: every granule its own chunk, as before): a
// live tenant pins at most a sixteenth of what the block it landed in had,
// though many tenants can pin all of it, where single granules would have
// let stitching move the free ones between them. A 287 MB tensor maps in 16
// MiB extents, one of 512 MiB or more in 32 MiB ones, 32 MiB and less
// granule by granule. Min capacity on the stress suite (sim), against every
// granule single (extent=2MiB): llama7b_b1_s2048 64,724 MiB against 64,360
// (expandable model 65,428), llama7b_b2_s4096_ckpt 64,542 against 64,296
// (64,768), llama1b_b4 48,874 against 48,822 (49,008),
// llama1b_b32_s4096_ckpt 69,232 against 69,082 (69,266), vit_l 40,290
// against 40,272 (40,322), resnet50 10,998 against 10,944 (11,050), the
// twelve others equal. Tried: 32 MiB extents under any
// whole granules of a request, 8 MiB ones, and 32 MiB ones only while
// reserved memory was under half the limit: interleaved_lifetimes needed
// 744, 672 and 670 MiB against 656 (expandable model 700) and llama7b_b1
// 65,592, 64,820 and 65,592; 1/8 of the request instead of 1/16, 65,166 on
// llama7b_b1; 1/32, 64,488, and 1/64, 64,370, but then llama1b_b4 reserves
// 50,726 and 51,002 MiB with no limit, above the expandable model's 50,388.
// With no limit, against the allocator before extents (ad74fdf): peak
// reserved on vit_l_b256_s224 40,448 MiB against 40,362, 22 above the
// expandable model's 40,426 (issue 18 asks for no more than either model;
// 40,292 since warm donors past a standing peak, Note [Cold donors]);
// llama7b_b1 64,852 against 64,506, llama7b_b2 64,508 against 64,298,
// llama1b_b32 70,584 against 70,566, resnet50 10,996 against 10,960,
// llama1b_b4 49,800 against 50,002; batch_growth 1,626 against 1,624; every
// other workload the same
// (docs/benchmarks/2026-11-27-extents.md).
// Moving memory (reuse before growing, stitching) maps single granules again
// in the window, as before extents, and gives extents back to the backend,
// whose memory the window then creates anew (a create and a release more per
// extent than a remap, which would need the window's holes cut to its size;
// and memory another process may take in between: stitching then retries
// once).
// Every chunk is recorded in phys[] under each granule it covers
// (extent_start finds its first).
//

#include <algorithm>
#include <cassert>

#include "blocks/arena.hpp"
#include "device/device_allocator.hpp"

namespace pyalloc {

namespace {
// An extent is at most this fraction of the request it is made for (Note [Extents]).
constexpr size_t kExtentShare = 16;
}  // namespace

// ---- new memory --------------------------------------------------------------------

// Granules the allocator may still reserve: before its limit, and within
// the device's free memory as the backend reports it now (other processes'
// memory included; the backend may still run out sooner).
size_t DeviceAllocator::reservable_granules() {
  const size_t reserved = static_cast<size_t>(stats_.reserved_bytes.current(kStatAll));
  const MemInfo info = backend_->mem_info(device_);
  const size_t device = info.total_bytes != 0 ? reserved + info.free_bytes : SIZE_MAX;
  const size_t limit = std::min(reserved_limit(), device);
  return reserved < limit ? (limit - reserved) / granule_ : 0;
}

// Granules that a growth needing `granules` still lacks: beyond the moved
// single granules waiting in spares_ and what the allocator may still reserve.
size_t DeviceAllocator::granules_lacking(size_t granules) {
  const size_t have = spares_.size() + reservable_granules();
  return have >= granules ? 0 : granules - have;
}

// Appends `n` new single granules from the backend to `handles`: all, or
// none (false).
bool DeviceAllocator::new_granules(size_t n, std::vector<PhysHandle>* handles) {
  const size_t before = handles->size();
  for (size_t made = 0; made < n; ++made) {
    PhysHandle h;
    if (!succeeded(backend_->phys_create(device_, granule_, &h))) {
      release_chunks(handles->data() + before, made);
      handles->resize(before);
      return false;
    }
    ++stats_.num_device_alloc;
    handles->push_back(h);
  }
  return true;
}

void DeviceAllocator::release_chunks(const PhysHandle* chunks, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    backend_->phys_release(device_, chunks[i]);
    ++stats_.num_device_free;
  }
}

// Maps every hole of the window [lo, hi) of `arena` (Note [Extents]): the
// single granules of `spares` first, as many as there are, lowest first;
// then new memory from the backend: extents under the granules that the
// request [req_lo, req_hi) lies over wholly, single granules under the rest.
// All or nothing: kNoMemory when the backend cannot create it all (nothing
// changed, `spares` as they were); kMapFailed when a map failed (the holes
// before it mapped, free; the rest of the memory given back). Spares the
// window does not need stay in `spares`.
DeviceAllocator::Fill DeviceAllocator::map_window(Segment* arena, uintptr_t lo, uintptr_t hi, uintptr_t req_lo,
                                                  uintptr_t req_hi, std::vector<PhysHandle>* spares) {
  const size_t g = granule_;
  // The largest power-of-two number of granules, up to extent_bytes_, that
  // is at most 1/kExtentShare of the request (Note [Extents]).
  size_t extent = g;
  while (extent * 2 <= extent_bytes_ && extent * 2 * kExtentShare <= req_hi - req_lo) extent *= 2;
  // Where the granules that the request lies over wholly end.
  const uintptr_t whole_hi = arena->base + (req_hi - arena->base) / g * g;
  std::vector<Piece>& pieces = pieces_;  // capacity kept between growths
  std::vector<PhysHandle>& handles = grow_handles_;
  pieces.clear();
  handles.clear();
  size_t single = spares->size();  // granules the spares map, from the window's start
  for (const Block* b = block_near_holes(arena, lo); b != nullptr && b->addr < hi; b = b->next) {
    if (b->state != BlockState::kHole || end_of(b) <= lo) continue;
    const uintptr_t z = std::min(hi, end_of(b));
    for (uintptr_t va = std::max(lo, b->addr); va < z;) {
      // Wholly under the request: an extent, as far as the hole and the request allow.
      size_t size = va >= req_lo && va + g <= whole_hi ? std::min({extent, z - va, whole_hi - va}) : g;
      if (single > 0) {
        size = g;
        --single;
      }
      pieces.push_back(Piece{va, size});
      va += size;
    }
  }
  const size_t spared = std::min(spares->size(), pieces.size());  // the first pieces, all single
  for (size_t i = 0; i < pieces.size(); ++i) {
    PhysHandle h;
    if (i < spared) {
      h = (*spares)[spares->size() - 1 - i];
    } else if (!succeeded(backend_->phys_create(device_, pieces[i].size, &h))) {
      release_chunks(handles.data() + spared, handles.size() - spared);  // the new ones; the spares stay
      return Fill::kNoMemory;
    } else {
      ++stats_.num_device_alloc;
    }
    handles.push_back(h);
  }
  spares->resize(spares->size() - spared);
  // Map hole by hole: runs of pieces laid end to end. fill_hole coalesces,
  // so each hole is found again by address.
  for (size_t i = 0; i < pieces.size();) {
    size_t j = i + 1;
    while (j < pieces.size() && pieces[j].va == pieces[j - 1].va + pieces[j - 1].size) ++j;
    const uintptr_t a = pieces[i].va;
    const uintptr_t z = pieces[j - 1].va + pieces[j - 1].size;
    if (fill_hole(block_near_holes(arena, a), a, z, handles.data() + i, j - i) == nullptr) {
      release_chunks(handles.data() + i, handles.size() - i);  // those not mapped
      return Fill::kMapFailed;
    }
    i = j;
  }
  return Fill::kDone;
}

// ---- mapping and unmapping ----------------------------------------------------------

// Maps handles[0..n), whose sizes add up to hi - lo, end to end over the
// granule-aligned range [lo, hi) of `hole`, which becomes free and
// coalesces. Returns the free block now holding [lo, hi), or nullptr when the
// map failed (the hole as it was; the handles are still the caller's).
Block* DeviceAllocator::fill_hole(Block* hole, uintptr_t lo, uintptr_t hi, const PhysHandle* handles, size_t n) {
  Segment* arena = hole->segment;
  const size_t g = granule_;
  // The chunks of [lo, hi) in one backend call, all or none (Note [Backend time]).
  if (!succeeded(backend_->map_range(device_, lo, handles, n))) return nullptr;
  uintptr_t va = lo;
  for (size_t i = 0; i < n; ++i) {
    std::fill_n(arena->phys.begin() + static_cast<std::ptrdiff_t>((va - arena->base) / g), handles[i].size / g,
                handles[i]);
    trace_.record(TraceAction::kSegmentMap, va, handles[i].size, arena->stream);
    va += handles[i].size;
  }
  assert(va == hi);
  arena->mapped += hi - lo;
  stats_.reserved_bytes.increase(arena->pool->stat, static_cast<int64_t>(hi - lo));
  // Carve [lo, hi) out of the hole as a free block; what lies before and
  // after stays a hole.
  arena->holes.erase(hole);
  Block* middle = hole;
  if (lo > hole->addr) {
    middle = split_block(hole, lo - hole->addr);
    arena->holes.insert(hole);
  }
  if (end_of(middle) > hi) arena->holes.insert(split_block(middle, hi - middle->addr));
  middle->state = BlockState::kFree;
  Block* merged = insert_coalesced(middle);
  reserved_changed();
  return merged;
}

// Unmaps [lo, hi), whole chunks (whole_chunks) of the free block `block`
// (which must be in its free set). Single granules go to `spares`, when
// given, to be mapped again; extents, or everything when `spares` is null,
// go back to the backend. The arena's stream must be synchronized.
void DeviceAllocator::unmap_free_range(Block* block, uintptr_t lo, uintptr_t hi, std::vector<PhysHandle>* spares) {
  assert(lo < hi);
  Segment* arena = block->segment;
  const size_t g = granule_;
  Block* middle = carve_free(block, lo, hi);
  std::vector<PhysHandle>& chunks = chunks_;  // capacity kept between calls
  chunks.clear();
  for (uintptr_t va = lo; va < hi; va += chunks.back().size) {
    assert(extent_start(arena, (va - arena->base) / g, g) == (va - arena->base) / g);
    chunks.push_back(arena->phys[(va - arena->base) / g]);
  }
  breaks_capture();
  backend_->unmap_range(device_, lo, chunks.data(), chunks.size());  // one call (Note [Backend time])
  std::fill_n(arena->phys.begin() + static_cast<std::ptrdiff_t>((lo - arena->base) / g), (hi - lo) / g, PhysHandle{});
  uintptr_t va = lo;
  for (const PhysHandle& chunk : chunks) {
    trace_.record(TraceAction::kSegmentUnmap, va, chunk.size, arena->stream);
    va += chunk.size;
    if (spares != nullptr && chunk.size == g) {
      spares->push_back(chunk);
    } else {
      release_chunks(&chunk, 1);
    }
  }
  arena->mapped -= hi - lo;
  stats_.reserved_bytes.decrease(arena->pool->stat, static_cast<int64_t>(hi - lo));
  middle->state = BlockState::kHole;
  merge_holes(middle);
  reserved_changed();
}

// The end of the shortest run of whole chunks from `lo` (a chunk's start)
// that holds `granules` granules, or `hi` (a chunk's end) when [lo, hi)
// holds fewer.
uintptr_t DeviceAllocator::chunks_holding(const Segment* arena, uintptr_t lo, uintptr_t hi, size_t granules) const {
  uintptr_t z = lo;
  while (z < hi && (z - lo) / granule_ < granules) z += arena->phys[(z - arena->base) / granule_].size;
  return z;
}

}  // namespace pyalloc
