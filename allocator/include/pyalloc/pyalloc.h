/*
 * pyalloc.h: the C ABI of libpyalloc.so, the one public header.
 *
 * A caching, stream-ordered GPU memory allocator. PyTorch loads it through
 * torch.cuda.memory.CUDAPluggableAllocator, CuPy through CFunctionAllocator,
 * and Python tools through ctypes. All of them call these entry points.
 *
 * Contract shared by every function:
 *   - No C++ exception ever crosses this ABI.
 *   - Functions returning int return PYALLOC_OK (0) on success, else one of
 *     the PYALLOC_E* codes below; pyalloc_last_error() then holds a one-line,
 *     thread-local message naming the problem.
 *   - A bad call (unknown pointer, double free, size overflow, device out of
 *     range) is counted in the stats, reported through pyalloc_last_error(),
 *     and leaves the allocator's state exactly as it was.
 *   - Every function is thread-safe. Pressure callbacks are never invoked
 *     while an allocator lock is held.
 *
 * Streams are opaque: on the cuda backend a `void* stream` is a CUstream
 * (== cudaStream_t; NULL is the legacy default stream); on the host and sim
 * backends it is any value naming a stream.
 */
#ifndef PYALLOC_PYALLOC_H
#define PYALLOC_PYALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define PYALLOC_API __attribute__((visibility("default")))
#else
#define PYALLOC_API
#endif

#define PYALLOC_VERSION "0.1.0"

enum pyalloc_status {
  PYALLOC_OK = 0,
  PYALLOC_EINVAL = 1,   /* bad argument: unknown pointer, bad size, bad config */
  PYALLOC_ENOMEM = 2,   /* out of memory after the whole pressure ladder */
  PYALLOC_EDEVICE = 3,  /* device index out of range */
  PYALLOC_EBUSY = 4,    /* refused while allocations are live */
  PYALLOC_EBACKEND = 5  /* the backend failed (no driver, driver error) */
};

/* ---- PyTorch CUDAPluggableAllocator ------------------------------------ */

/* Returns a block of at least `size` bytes usable on `stream`, or NULL.
 * malloc of size 0 returns NULL and is not an error (pyalloc_last_error is
 * left untouched); free(NULL, ...) is a no-op. NULL for size > 0 means the
 * request failed: out of memory (an OOM report is in pyalloc_last_error and
 * the stats) or a bad argument. */
PYALLOC_API void* pyalloc_malloc(size_t size, int device, void* stream);
/* `size` must be the size passed to pyalloc_malloc and `stream` its stream
 * (PyTorch passes both), or PYALLOC_ANY_STREAM when the caller does not know
 * it (and SIZE_MAX for a size it does not know: not checked); a mismatch is
 * reported and the block is NOT freed (it may belong to someone else, and a
 * use on another stream is declared with pyalloc_record_stream, not at the
 * free). */
#define PYALLOC_ANY_STREAM ((void*)~(uintptr_t)0)
PYALLOC_API void pyalloc_free(void* ptr, size_t size, int device, void* stream);
/* Marks `ptr` as used on `stream`: its memory is not reused until work queued
 * on `stream` at the time of the free has completed. */
PYALLOC_API void pyalloc_record_stream(void* ptr, void* stream);
/* The bytes of the free blocks just below and just above the live allocation
 * at `ptr` (0 where the neighbour is allocated, pending or absent): how much
 * contiguous space freeing it would open, MegEngine's free-neighbour term.
 * PYALLOC_OK, or PYALLOC_EINVAL when `ptr` is not a live allocation. */
PYALLOC_API int pyalloc_free_neighbours(void* ptr, size_t* free_below, size_t* free_above);
/* Releases every cached, fully free segment of every device to the backend. */
PYALLOC_API void pyalloc_empty_cache(void);
/* Caps reserved memory of `device` at fraction * device capacity. */
PYALLOC_API void pyalloc_set_memory_fraction(double fraction, int device);

/* What PyTorch's out-of-memory message and CUDAAllocator::cacheInfo need,
 * read in one step under the device's lock (the torch-facing layer,
 * cuda/torch/). */
typedef struct pyalloc_memory_info_t {
  size_t device_total;    /* bytes the device has */
  size_t device_free;     /* bytes free on the device now, as the backend reports it */
  size_t reserved;        /* bytes this allocator holds on the device */
  size_t allocated;       /* bytes of live blocks */
  size_t limit;           /* what it may reserve: the memory fraction's cap, else device_total */
  size_t largest_cached;  /* the largest cached free block */
  size_t largest_request; /* the largest request served without releasing anything:
                             the largest cached block, or what it may still reserve
                             (the smaller of device_free and limit - reserved) */
} pyalloc_memory_info_t;
/* PYALLOC_OK, or PYALLOC_EDEVICE / PYALLOC_EINVAL (out NULL). */
PYALLOC_API int pyalloc_memory_info(int device, pyalloc_memory_info_t* out);

/* The segments and blocks of a snapshot (pyalloc_snapshot_json's "segments"),
 * handed to callbacks instead of written as JSON: one segment per plain
 * segment and per mapped run of an arena, then each of its blocks, in
 * address order. The callbacks run under the device's lock and must not call
 * into pyalloc. */
typedef struct pyalloc_segment_info_t {
  uintptr_t address;
  size_t total_size;
  size_t allocated_size;
  size_t active_size;     /* allocated, or freed and waiting on other streams' events */
  size_t requested_size;
  void* stream;
  int is_large;           /* 0 for the small pool's segments */
  int is_expandable;      /* a mapped run of a virtual-memory arena */
  int pool_id;            /* 0 for the default pools, else the user pool's id */
} pyalloc_segment_info_t;
typedef struct pyalloc_block_info_t {
  uintptr_t address;
  size_t size;
  size_t requested_size;
  int allocated;
  int active;
} pyalloc_block_info_t;
typedef void (*pyalloc_segment_fn)(const pyalloc_segment_info_t* segment, void* user_data);
typedef void (*pyalloc_block_fn)(const pyalloc_block_info_t* block, void* user_data);
/* PYALLOC_OK, or PYALLOC_EDEVICE / PYALLOC_EINVAL (a callback NULL). */
PYALLOC_API int pyalloc_snapshot_walk(int device, pyalloc_segment_fn segment, pyalloc_block_fn block,
                                      void* user_data);

/* ---- CuPy CFunctionAllocator -------------------------------------------- */

/* `param` is ignored. The stream is the one set with
 * pyalloc_cupy_set_stream() on this thread (CuPy's current stream). */
PYALLOC_API void* pyalloc_cupy_malloc(void* param, size_t size, int device);
PYALLOC_API void pyalloc_cupy_free(void* param, void* ptr, int device);
PYALLOC_API void pyalloc_cupy_set_stream(void* stream);

/* ---- control and introspection ------------------------------------------ */

/* Same syntax as PYALLOC_CONF: comma-separated key=value. All keys are
 * validated before any is applied; keys not named keep the values in force
 * (an earlier call's included), as PYALLOC_CONF sets only the keys it names
 * over the defaults. Keys that change the memory layout
 * (backend, capacity, devices, segment sizes, ...) are accepted only while no
 * allocation is live; the allocator is then rebuilt. */
PYALLOC_API int pyalloc_configure(const char* conf);
PYALLOC_API const char* pyalloc_last_error(void);
/* snprintf-style: writes at most len bytes (NUL-terminated when len > 0) and
 * returns the full length of the JSON text, excluding the NUL; len 0 sizes it. */
PYALLOC_API size_t pyalloc_stats_json(int device, char* buf, size_t len);
PYALLOC_API size_t pyalloc_snapshot_json(char* buf, size_t len);
/* Full invariant walk of one device. 0 = consistent; otherwise the first
 * violation is described in pyalloc_last_error(). */
PYALLOC_API int pyalloc_check(int device);

/* ---- additions ----------------------------------------------------------- */

PYALLOC_API const char* pyalloc_version(void);
/* Empties this thread's pyalloc_last_error(), so that a void entry point's
 * failure can be told apart from an earlier one. */
PYALLOC_API void pyalloc_clear_last_error(void);
/* Number of devices of the configured backend (0 if it failed to start). */
PYALLOC_API int pyalloc_device_count(void);
/* The configuration in force, as JSON (snprintf-style, like stats). */
PYALLOC_API size_t pyalloc_config_json(char* buf, size_t len);
/* Peaks reset to current values; accumulated counts reset to zero. */
PYALLOC_API int pyalloc_reset_peak_stats(int device);
PYALLOC_API int pyalloc_reset_accumulated_stats(int device);
/* Releases cached, fully free segments of `device`, oldest first, until at
 * least `bytes` were released (0 = all). Writes the bytes released. */
PYALLOC_API int pyalloc_release_cached(int device, size_t bytes, size_t* released);

/* User pools. Pool 0 is the default (small/large by size). A pool created
 * with a name that exists returns the existing id. The current pool is
 * thread-local and applies to allocations made by this thread. */
PYALLOC_API int pyalloc_pool_create(const char* name, int* pool_id);
PYALLOC_API int pyalloc_set_current_pool(int pool_id);
PYALLOC_API int pyalloc_current_pool(void);
/* Holds (held != 0) or lets go user pool `pool_id` on every device. A held
 * pool's memory stays where it is: it grows by plain segments, and its free
 * memory is released by pyalloc_pool_empty_cache only, never by
 * pyalloc_empty_cache, max_cached or the pressure ladder (a CUDA graph
 * replays into the addresses its capture saw). Hold a pool before its first
 * allocation: PYALLOC_EINVAL when it already has virtual-memory arenas. */
PYALLOC_API int pyalloc_pool_hold(int pool_id, int held);
/* Releases the wholly free segments of user pool `pool_id` on every device,
 * held or not; writes the bytes released and the bytes the pool still
 * reserves (segments with live blocks). Either pointer may be NULL. */
PYALLOC_API int pyalloc_pool_empty_cache(int pool_id, size_t* released, size_t* still_reserved);
/* A cached free block of user pool `pool_id` that fits `size` on `device`
 * and `stream`, allocated as pyalloc_malloc would; NULL when none does.
 * Nothing grows, nothing is released, no OOM is counted (torch.cuda.MemPool's
 * use_on_oom: a pool's cache tried before an out-of-memory error). */
PYALLOC_API void* pyalloc_pool_take_cached(int pool_id, size_t size, int device, void* stream);
/* A CUDA stream capture began / ended on `device` (captures nest). Between
 * the two the device serves requests from its cache and by growing only: it
 * queries no event, synchronizes nothing, releases and remaps no memory, and
 * defers frees that would (see Note [Capture] in device/pools.cpp). */
PYALLOC_API int pyalloc_capture_begin(int device);
/* Sharing a live block with another process of this machine (Note [Sharing
 * blocks] in device/ipc.cpp; torch.multiprocessing). Export writes the
 * handle's bytes to `buf` (at most `len`; pass NULL to learn the length) and
 * their count to *handle_len, and the block's offset in the memory the
 * handle maps to *offset. PYALLOC_EINVAL when `ptr` is not the start of a
 * live allocation, PYALLOC_EBACKEND when its memory cannot be shared. */
PYALLOC_API int pyalloc_ipc_export(void* ptr, void* buf, size_t len, size_t* handle_len, size_t* offset);
/* The handle's bytes (little-endian, 40-byte header): "pyalloc-ipc\0",
 * version (uint8, 1), kind (uint8: 'S' a plain segment, 'G' granules), two
 * zero bytes, the number of parts (uint32), four zero bytes, the bytes the
 * importer maps (uint64; 0 when unknown), each granule's size (uint64, 'G');
 * then each part as its length (uint32) and the backend's bytes: for 'S' on
 * the cuda backend, the 64 bytes of cuIpcGetMemHandle. */
/* In the other process: maps the memory a handle describes on `device` at
 * *base (the block is at *base + offset), until pyalloc_ipc_close. */
PYALLOC_API int pyalloc_ipc_import(int device, const void* handle, size_t len, void** base);
PYALLOC_API int pyalloc_ipc_close(int device, void* base);
PYALLOC_API int pyalloc_capture_end(int device);

/* Pressure callbacks: step 3 of the pressure ladder. Called, without any
 * allocator lock held, when an allocation of `bytes_needed` on `device` could
 * not be served even after cached memory was released. The callback frees
 * what it can (e.g. by calling pyalloc_free) and returns the number of bytes
 * it freed. Callbacks are not re-entered: an allocation made from inside a
 * callback skips step 3. */
typedef size_t (*pyalloc_pressure_fn)(int device, size_t bytes_needed, void* user_data);
PYALLOC_API int pyalloc_register_pressure_callback(pyalloc_pressure_fn fn, void* user_data,
                                                   int* handle);
PYALLOC_API int pyalloc_unregister_pressure_callback(int handle);

/* ---- trace replay ----------------------------------------------------------- */

typedef struct pyalloc_replay_result {
  uint64_t ops;                        /* allocations and frees replayed */
  uint64_t peak_live_bytes;            /* most requested bytes live at once */
  uint64_t peak_reserved_bytes;        /* most bytes the policy held in segments */
  uint64_t largest_free_at_peak_bytes; /* largest free block when live bytes peaked */
  uint64_t ooms;                       /* allocations that failed */
  double ns_per_op;                    /* allocator time per operation (timed pass) */
} pyalloc_replay_result;

/* Replays a trace held in parallel arrays of n events: ops[i] is 0 (alloc),
 * 1 (free) or 2 (mark, skipped); slots[i] < n_slots names the allocation
 * (trace ids remapped densely); sizes[i] is the requested size (also on
 * frees); streams[i] the stream. policy "pyalloc" replays through this
 * allocator's C ABI on device 0 as configured (use backend=sim at GPU scale);
 * "native" through a model of PyTorch's default caching policy with
 * `capacity` bytes. Runs a timed pass, then a measured one. If curve_points
 * > 0, writes live and reserved bytes sampled at evenly spaced events. */
PYALLOC_API int pyalloc_replay(const char* policy, size_t capacity, const unsigned char* ops,
                               const uint32_t* slots, const uint64_t* sizes, const uint64_t* streams,
                               size_t n, size_t n_slots, uint64_t* curve_live, uint64_t* curve_reserved,
                               size_t curve_points, pyalloc_replay_result* out);

#ifdef __cplusplus
}
#endif

#endif /* PYALLOC_PYALLOC_H */
