"""gpumemd: per-process GPU memory with allocator internals, a Prometheus exporter,
a policy-driven reaper of stale GPU processes, and pressure coordination between
pyalloc processes. See docs/deployment.md."""
