"""``pyalloc gpu-check``: everything that needs a GPU, in one command, with one report.

What lives here: the command (``run``: the checks in order, a time budget, ``gpu-check.json``
and ``gpu-check.md``) and the checks themselves (``child``: each runs in a fresh interpreter,
``python -m pyalloc.gpucheck.child CHECK CONFIG``, because ``pyalloc.install()`` must come before
a process's first CUDA call and an allocator can be chosen only once per process); the
largest-batch search they share (``batch_search``); the offload check (``offload``: the plain
step, checkpointing, ``save_on_cpu`` and ``pyalloc.offload`` on one model, issue 20).

May import: the core binding, the command contract, ``pyalloc.pytorch`` (install), ``pyalloc.traces``
(the models of ``meta_models``), ``pyalloc.offloading`` (the session and the offload benchmark's
models), and torch, inside functions or in the modules only the child imports (``offload``).

Must never come here: allocator policy, or a figure that was not measured on the machine the
report names (a check that cannot run says so in the report).
"""
