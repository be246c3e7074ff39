"""``pyalloc doctor``: why memory grows, who holds it at the peak, and what to change.

What lives here: the storage tracker (``tracker``: a TorchDispatchMode that sees every storage an
operator creates and, through a weak reference, its death; the same technique as Note [Meta
recordings]), attribution of allocations to the first frame of the user's own code (``sites``),
growth across iterations and its causes (``growth``), the owners of memory at the peak and the
advice ranked by bytes (``owners``, ``advice``), the report and its text (``report``), the
context manager ``pyalloc.doctor()`` (``session``), the process-wide doctor the bootstrap starts
(``process``) and the ``pyalloc doctor`` command (``run``).

May import: the core binding, the command contract, ``pyalloc.pytorch`` (install state, the
bootstrap's folder), ``pyalloc.gpumemd`` (other processes on a GPU, read only), and torch.

Must never come here: allocator policy, the offload manager (the doctor only measures what
offloading would save), trace tooling.
"""
