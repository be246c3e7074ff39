// device_allocator.cpp: the device allocator's life, settings, limits and
// pools; the calls that change no block (record_stream, free_neighbours).
// The fast path is fast_path.hpp, the slow path slow_path.cpp, arenas
// arena.cpp and share.cpp, placement policies placement.cpp, stats, checks
// and reports reports.cpp.
#include "device/device_allocator.hpp"

#include <algorithm>

#include "device/fast_path.hpp"

namespace pyalloc {

DeviceAllocator::DeviceAllocator(int device, const Config& config, MeteredBackend* backend,
                                 DeviceHooks& hooks)
    : device_(device),
      backend_(backend),
      hooks_(hooks),
      small_segment_(config.small_segment),
      large_segment_(config.large_segment),
      largest_small_(config.vmm_mode() == VmmMode::kShared ? 0 : kSmallRequest),
      vmm_(config.vmm_mode()),
      planning_(config.plan),
      placing_lifetimes_(config.lifetime),
      small_pool_(PoolKind::kSmall, 0, kSmallPoolName),
      large_pool_(PoolKind::kLarge, 0, kLargePoolName),
      plan_pool_(PoolKind::kPlan, 0, kPlanPoolName),
      long_pool_(PoolKind::kLong, 0, kLongPoolName) {
  small_pool_.in_arenas = vmm_ == VmmMode::kAll;
  large_pool_.in_arenas = vmm_ != VmmMode::kOff;
  long_pool_.in_arenas = vmm_ != VmmMode::kOff;
  apply_settings(config);
  if (planning_) observe();
  if (placing_lifetimes_) divert_ |= kDivertLifetime;
}

DeviceAllocator::~DeviceAllocator() {
  // Host-side bookkeeping only: no backend call (see Note [Shutdown]). The
  // blocks go with block_slabs_.
  for (auto& entry : segments_) delete entry.second;
}

// ---- settings and limits -------------------------------------------------------------

void DeviceAllocator::apply_settings(const Config& config) {
  Lock lock(mutex_);
  memory_fraction_ = config.memory_fraction;
  max_cached_ = config.max_cached;
  round_power2_ = config.round_power2;
  oom_report_ = config.oom_report;
  sharing_ = config.share;
  moving_ = config.moving();
  reusing_ = config.reuse;
  extent_bytes_ = config.extent;
  update_share_from();
  if (trace_.capacity() != config.trace) trace_.resize(config.trace);
  divert_ = static_cast<uint8_t>(trace_.on() ? divert_ | kDivertTrace : divert_ & ~kDivertTrace);
  if (cached_free_bytes_ > max_cached_) enforce_max_cached();
}

void DeviceAllocator::set_memory_fraction(double fraction) {
  Lock lock(mutex_);
  memory_fraction_ = fraction;
  update_share_from();
}

// 95% of what the device, or the memory fraction, lets this allocator reserve
// (Note [Shared granules]); never without sharing or arenas, or when the
// backend reports no total. Measured on the stress suite against 80%, 90% and
// 98% (docs/benchmarks/2026-11-22-shared-granules-cpu.md).
void DeviceAllocator::update_share_from() {
  const size_t limit = std::min(reserved_limit(), device_total());
  near_limit_ = limit != 0 ? limit / 20 * 19 : SIZE_MAX;
  share_from_ = sharing_ && vmm_ != VmmMode::kOff ? near_limit_ : SIZE_MAX;
  share_limit_ = limit;
  if (divert_ & kDivertSlivers) drop_sliver_indexes(false);
  settle_whole_count(static_cast<size_t>(stats_.reserved_bytes.current(kStatAll)));
}

// Asked lazily: on cuda, asking creates the device's context, which a
// process must not pay for devices it never uses.
size_t DeviceAllocator::device_total() {
  if (device_total_ == 0) device_total_ = backend_->mem_info(device_).total_bytes;
  return device_total_;
}

size_t DeviceAllocator::reserved_limit() {
  if (memory_fraction_ >= 1.0) return SIZE_MAX;
  return static_cast<size_t>(memory_fraction_ * static_cast<double>(device_total()));
}

// ---- pools ----------------------------------------------------------------------------

Pool& DeviceAllocator::user_pool(int pool_id) {
  const size_t index = static_cast<size_t>(pool_id - 1);
  if (index >= user_pools_.size()) user_pools_.resize(index + 1);
  if (!user_pools_[index]) {
    user_pools_[index] = std::make_unique<Pool>(PoolKind::kUser, pool_id, hooks_.pool_name(pool_id));
    user_pools_[index]->held = hooks_.pool_held(pool_id);  // Note [Held pools]
    user_pools_[index]->in_arenas = vmm_ != VmmMode::kOff && !user_pools_[index]->held;
  }
  return *user_pools_[index];
}

size_t DeviceAllocator::segment_size_for(const Pool& pool, size_t rounded) const {
  if (pool.kind == PoolKind::kSmall || rounded <= kSmallRequest) return small_segment_;
  if (rounded < large_segment_ / 2) return large_segment_;
  return round_up_to(rounded, kLargeRound);
}

std::vector<Pool*> DeviceAllocator::pools() {
  std::vector<Pool*> out = {&small_pool_, &large_pool_, &long_pool_, &plan_pool_};
  for (const auto& pool : user_pools_) {
    if (pool) out.push_back(pool.get());
  }
  return out;
}

std::vector<const Pool*> DeviceAllocator::pools() const {
  const std::vector<Pool*> all = const_cast<DeviceAllocator*>(this)->pools();
  return {all.begin(), all.end()};
}

// ---- calls that change no block --------------------------------------------------------

bool DeviceAllocator::record_stream(uintptr_t addr, StreamId stream) {
  Lock lock(mutex_);
  auto* entry = live_.find(addr);
  if (entry == nullptr) return false;
  Block* block = entry->value;
  // Use on the allocation stream is already ordered; nothing to wait for.
  if (stream != block->stream &&
      std::find(block->uses.begin(), block->uses.end(), stream) == block->uses.end()) {
    block->uses.push_back(stream);
  }
  return true;
}

bool DeviceAllocator::free_neighbours(uintptr_t addr, size_t* below, size_t* above) {
  Lock lock(mutex_);
  auto* entry = live_.find(addr);
  if (entry == nullptr) return false;
  const Block* block = entry->value;
  // Free neighbours are already coalesced (I2): one block on each side at most.
  *below = block->prev != nullptr && block->prev->is_free() ? block->prev->size : 0;
  *above = block->next != nullptr && block->next->is_free() ? block->next->size : 0;
  return true;
}

void DeviceAllocator::count_invalid_size() {
  Lock lock(mutex_);
  ++stats_.num_invalid_size;
}

// ---- reconfiguration --------------------------------------------------------------------

bool DeviceAllocator::retire_if_idle(int64_t* live_bytes) {
  Lock lock(mutex_);
  *live_bytes = stats_.allocated_bytes.current(kStatAll);
  if (live_.size() != 0 || !pending_.empty()) {
    // Pending frees finish on their own; only live allocations block.
    if (live_.size() == 0) {
      synchronize_pending();
    } else {
      return false;
    }
  }
  drop_plan();
  release_cached_memory(0);
  divert_ |= kDivertRetired;
  return true;
}

void DeviceAllocator::unretire() {
  Lock lock(mutex_);
  divert_ &= ~kDivertRetired;
}

}  // namespace pyalloc
