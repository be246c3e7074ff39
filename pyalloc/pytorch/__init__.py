"""pyalloc inside PyTorch.

What lives here: :func:`pyalloc.install` (``install``: PyTorch's pluggable-allocator hook), the
replacements of ``torch.cuda``'s memory API that report pyalloc's figures (``memory_api``),
training-state pools (``training_state``: ``pyalloc.relocate_training_state``), and ``pyalloc
run`` (``run``, with ``_bootstrap/sitecustomize.py``, which installs pyalloc in every Python
process the command starts).

May import: the core binding (``pyalloc._lib``, ``pyalloc.core``), ``pyalloc.cli`` (the command
contract), and torch, inside functions or in modules only imported once torch is wanted.

Must never come here: allocator policy (that is libpyalloc's), the offload manager (it imports
this package, not the other way round), trace tooling, gpumemd.
"""
