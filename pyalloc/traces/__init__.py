"""Measuring instruments: traces of real models, their replay, and the stress suite.

What lives here: the trace format (``trace``), recording traces from PyTorch (``record``,
``models``), replaying them through pyalloc or a model of PyTorch's allocator (``replay``, in
C++ through ``pyalloc_replay``), generated adversarial patterns (``generators``), the stress
suite (``stress``: ``pyalloc stress``), the host-backend self test (``selftest``), and the
recorded workloads (``workloads/``).

May import: the core binding, ``pyalloc.cli`` (the command contract), ``pyalloc.pytorch`` (to
record under pyalloc), torch (recording only, inside functions).

Must never come here: anything the allocator needs at run time. Nothing outside this package
imports it but the CLI, by name.
"""
