"""gpumemd: per-process GPU memory with allocator internals, a Prometheus exporter,
a policy-driven reaper of stale GPU processes, and pressure coordination between
pyalloc processes. See docs/deployment.md.

What lives here: the daemon's command line (``cli``), its collectors (``nvml``, ``procinfo``,
``registry``: the reader and writer of pyalloc processes' shared-memory records, whose layout
is allocator/include/pyalloc/registry.h), the node's state (``model``), the Prometheus
exporter (``metrics``), the reaper (``reaper``), pressure coordination (``pressure``), and
its tables and units, and its log of events (``events``).

May import: the standard library, psutil, nvidia-ml-py, tomli (on Python 3.10, where the
standard library has no tomllib), and nothing of pyalloc outside this package. The Prometheus
text is written here (Note [One rendering per snapshot]); prometheus_client's parser checks it
in the tests.

Must never come here: torch, or libpyalloc (the ctypes core): the daemon runs on machines and
in containers where neither is loaded, and reads allocators only through their records.
"""
