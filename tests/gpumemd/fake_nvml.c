/* A stand-in libnvidia-ml.so.1 for the fault tests: the entry points gpumemd's collector
 * calls through nvidia-ml-py, answering for FAKE_NVML_DEVICES devices (default 2) of
 * 80 GiB, with the processes of FAKE_NVML_PIDS ("pid:device:bytes,..."). Faults come from
 * the file named by FAKE_NVML_FAULTS, read at every call, one per line:
 *     <device> <call> <NVML error code>
 * call is one of handle, memory, processes, utilization (device -1 and call "count" fail
 * nvmlDeviceGetCount). Editing the file mid-run fails the device in the middle of polls.
 * Built by tests/gpumemd/test_faults.py with the system C compiler. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum { OK = 0, NOT_SUPPORTED = 3, NOT_FOUND = 6, INSUFFICIENT_SIZE = 7 };
enum { MAX_DEVICES = 8, MAX_PROCS = 64 };

typedef struct { int index; } device_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } process_t;

static device_t devices[MAX_DEVICES];

static int device_count(void) {
  const char* n = getenv("FAKE_NVML_DEVICES");
  int count = n ? atoi(n) : 2;
  return count < 0 ? 0 : count > MAX_DEVICES ? MAX_DEVICES : count;
}

/* The error the fault file asks of (device, call), or OK. */
static nvmlReturn_t fault(int device, const char* call) {
  const char* path = getenv("FAKE_NVML_FAULTS");
  if (!path) return OK;
  FILE* f = fopen(path, "r");
  if (!f) return OK;
  int d, code;
  char name[32];
  nvmlReturn_t out = OK;
  while (fscanf(f, "%d %31s %d", &d, name, &code) == 3)
    if (d == device && strcmp(name, call) == 0) out = code;
  fclose(f);
  return out;
}

nvmlReturn_t nvmlInitWithFlags(unsigned flags) { (void)flags; return OK; }
nvmlReturn_t nvmlInit_v2(void) { return OK; }
nvmlReturn_t nvmlShutdown(void) { return OK; }

const char* nvmlErrorString(nvmlReturn_t r) {
  switch (r) {
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 10: return "Timeout";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
  }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char* out, unsigned len) {
  snprintf(out, len, "999.99-fake");
  return OK;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned* count) {
  nvmlReturn_t e = fault(-1, "count");
  if (e) return e;
  *count = (unsigned)device_count();
  return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, device_t** handle) {
  if ((int)index >= device_count()) return 2; /* invalid argument */
  nvmlReturn_t e = fault((int)index, "handle");
  if (e) return e;
  devices[index].index = (int)index;
  *handle = &devices[index];
  return OK;
}

nvmlReturn_t nvmlDeviceGetName(device_t* h, char* out, unsigned len) {
  snprintf(out, len, "Fake GPU %d", h->index);
  return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(device_t* h, char* out, unsigned len) {
  snprintf(out, len, "GPU-fake0000-0000-0000-0000-%012d", h->index);
  return OK;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(device_t* h, memory_t* m) {
  nvmlReturn_t e = fault(h->index, "memory");
  if (e) return e;
  m->total = 80ULL << 30;
  m->used = (unsigned long long)(h->index + 1) << 30;
  m->free = m->total - m->used;
  return OK;
}

nvmlReturn_t nvmlDeviceGetMigMode(device_t* h, unsigned* current, unsigned* pending) {
  (void)h; (void)current; (void)pending;
  return NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(device_t* h, void* samples, unsigned* count, unsigned long long since) {
  (void)samples; (void)count; (void)since;
  nvmlReturn_t e = fault(h->index, "utilization");
  return e ? e : NOT_FOUND; /* no kernel ran in the window */
}

static unsigned processes_of(int device, process_t* out, unsigned room) {
  const char* spec = getenv("FAKE_NVML_PIDS");
  unsigned n = 0;
  while (spec && *spec) {
    unsigned pid;
    int d;
    unsigned long long bytes;
    if (sscanf(spec, "%u:%d:%llu", &pid, &d, &bytes) == 3 && d == device) {
      if (out && n < room) out[n] = (process_t){pid, bytes, 0xFFFFFFFFu, 0xFFFFFFFFu};
      ++n;
    }
    const char* comma = strchr(spec, ',');
    spec = comma ? comma + 1 : NULL;
  }
  return n;
}

static nvmlReturn_t running(device_t* h, unsigned* count, process_t* infos, int graphics) {
  nvmlReturn_t e = fault(h->index, "processes");
  if (e) return e;
  unsigned n = graphics ? 0 : processes_of(h->index, NULL, 0);
  if (n == 0) { *count = 0; return OK; }
  if (!infos || *count < n) { *count = n; return INSUFFICIENT_SIZE; }
  *count = processes_of(h->index, infos, *count);
  return OK;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(device_t* h, unsigned* count, process_t* infos) {
  return running(h, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(device_t* h, unsigned* count, process_t* infos) {
  return running(h, count, infos, 1);
}
