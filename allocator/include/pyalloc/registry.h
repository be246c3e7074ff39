/*
 * registry.h: the shared-memory record a pyalloc process publishes for gpumemd.
 *
 * One file per process: /dev/shm/pyalloc.<uid>.<pid> ($PYALLOC_REGISTRY_DIR
 * overrides the folder), mode 0600, holding one
 * pyalloc_registry_record. The layout is fixed (little-endian, the x86-64 /
 * aarch64 ABI, no pointers) and versioned; readers check magic, version and
 * size before trusting anything, and validate every field.
 *
 * Writer: the process's registry thread (a few times a second, and on the
 * allocator's slow path through a flag), never the allocation fast path.
 * Readers (gpumemd) never see a torn record thanks to the sequence lock:
 *
 *   writer: seq += 1 (odd: writing); write fields; seq += 1 (even: stable)
 *   reader: s1 = seq; if odd, retry; copy the record; s2 = seq;
 *           if s1 != s2, retry
 *
 * Mailbox: the daemon posts a request by writing request_kind,
 * request_device and request_bytes, then incrementing request_seq. The
 * process's registry thread serves it and sets response_bytes, then
 * response_seq = request_seq. Requests and responses are single-writer
 * fields: the daemon writes only request_*, the process only the rest.
 */
#ifndef PYALLOC_REGISTRY_H
#define PYALLOC_REGISTRY_H

#include <stdint.h>

#define PYALLOC_REGISTRY_MAGIC 0x31474552434F4C41ull /* "ALOCREG1" little-endian */
#define PYALLOC_REGISTRY_VERSION 1u
#define PYALLOC_REGISTRY_MAX_DEVICES 16
#define PYALLOC_REGISTRY_COMMAND_LEN 256
#define PYALLOC_REGISTRY_DIR "/dev/shm"
#define PYALLOC_REGISTRY_PREFIX "pyalloc."

enum pyalloc_registry_request {
  PYALLOC_REQUEST_NONE = 0,
  PYALLOC_REQUEST_TRIM = 1 /* release cached memory of request_device: request_bytes (0 = all) */
};

enum pyalloc_registry_flags {
  PYALLOC_REGISTRY_PRESSURE_OPT_IN = 1u /* accepts trim requests from other processes' pressure */
};

typedef struct pyalloc_registry_device {
  uint64_t reserved_bytes;
  uint64_t allocated_bytes;
  uint64_t active_bytes;
  uint64_t cached_free_bytes;
  uint64_t largest_free_bytes;
  uint64_t swapped_out_bytes;
  uint64_t peak_reserved_bytes;
  uint64_t num_ooms;
  uint64_t num_alloc_retries;
  uint64_t last_alloc_unix_ns; /* 0: never allocated on this device */
} pyalloc_registry_device;

typedef struct pyalloc_registry_record {
  /* identity (written once) */
  uint64_t magic;
  uint32_t version;
  uint32_t record_size;   /* sizeof(pyalloc_registry_record) */
  uint64_t seq;           /* sequence lock: odd while the process writes */
  int32_t pid;
  uint32_t uid;
  uint64_t start_time_ticks; /* field 22 of /proc/<pid>/stat: tells a reused pid apart */
  char backend[16];          /* "cuda", "host", "sim"; NUL-terminated */
  char command[PYALLOC_REGISTRY_COMMAND_LEN]; /* argv joined by spaces, NUL-terminated */
  /* state */
  uint64_t heartbeat_unix_ns; /* CLOCK_REALTIME of the last update */
  uint32_t num_devices;       /* entries of devices[] in use */
  uint32_t flags;             /* pyalloc_registry_flags */
  pyalloc_registry_device devices[PYALLOC_REGISTRY_MAX_DEVICES];
  /* mailbox: daemon -> process */
  uint64_t request_seq;
  uint32_t request_kind;
  int32_t request_device;
  uint64_t request_bytes;
  /* mailbox: process -> daemon */
  uint64_t response_seq;
  uint64_t response_bytes;
  uint64_t requests_served;
} pyalloc_registry_record;

#endif /* PYALLOC_REGISTRY_H */
