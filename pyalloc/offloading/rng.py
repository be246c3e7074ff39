"""The generator states a re-run replays, so that it draws what the original call drew.

Note [Generator states]
    A re-run (a module call in backward, a DTR replay) must draw the random numbers the original
    call drew: a dropout's mask above all. Its state is taken before the call and put back for the
    re-run; afterwards the generators are set back to where they were, so the re-run draws nothing
    from the program's stream. Which generators: the CPU one always, and the CUDA generator of
    every device the call may draw on, which is each device of the tensors the call *received*,
    and the current device (a call may draw on it without a CUDA argument:
    ``torch.rand(n, device="cuda")``, or a module that makes its own noise).

    *Received*: a planned output call whose input is regenerated through another planned call
    holds a placeholder instead of that input (regions.py, ``_Link``). Until 2026-11-27 the
    devices were read from the arguments after that substitution, so a dropout whose input was
    regenerated (Linear -> GELU -> Dropout, each an output the plan drops) took no CUDA state at
    all, and its re-run in backward drew a new mask from wherever the generator stood. On the CPU
    nothing showed, since the CPU state is always taken (tests/test_offload_rng.py stands the
    CUDA generators in with CPU ones to show it). This was not the whole of the H200's
    difference: there, with this fix, a planned re-run of ``nn.Dropout`` still gave another mask
    (189,482 of 1,048,576 elements, step 1, the same with and without the fix; presumably that
    plan's dropout held its input, not a link, so the old capture had its device too: not
    measured). Why a restored state
    draws another mask there is not known yet: ``tests/gpu/test_offload_cuda.py``'s dropout test
    checks the replay alone (main thread, fresh copy, backward's thread, copies 4 and 8 bytes off).

    One known way, from PyTorch's source: CUDA's dropout (aten/src/ATen/native/cuda/Dropout.cu,
    ``get_vector_size`` and ``launcher``) runs ``fused_dropout_kernel_vec`` with a width its input
    pointer's alignment allows (16 bytes at most) when input, output and mask are dense, else
    ``fused_dropout_kernel``; from the same seed and offset the first gives element ``i`` a number
    of thread ``i / width``'s draws, the second one of thread ``i % threads``'s. So a re-run on an
    input laid out otherwise (strides, or the pointer mod 16) draws another mask. A CPU probe of
    both GPU scripts (2026-11-27, refills off as on CUDA, every budget from 1 to 24 MiB) found every
    dropout re-run's input laid out as the forward's, pointer mod 16 included, and CUDA's
    allocators (PyTorch's, pyalloc's: I8) align every block to 512 bytes, so this is not shown to
    be the H200's cause: the check's reports now give the re-run's input layouts
    (``inputs_alike``) and the GPU tests the kernel width each would get.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

__all__ = ["CudaStates", "cuda_devices", "cuda_states", "replayed"]

CudaStates = tuple[tuple[int, torch.Tensor], ...]
"""(device index, ``torch.cuda.get_rng_state(device)``) for each device, in index order."""


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The CUDA devices a call on ``tensors`` may draw on: theirs and, once CUDA is initialised,
    the current one (Note [Generator states]). Initialises nothing."""
    devices = {t.device.index or 0 for t in tensors if t.is_cuda}
    if torch.cuda.is_initialized():
        devices.add(torch.cuda.current_device())
    return sorted(devices)


def cuda_states(tensors: Iterable[torch.Tensor], cuda: bool) -> CudaStates:
    """The CUDA generators' states for a call on ``tensors``; empty when ``cuda`` is off (no CUDA
    in this process)."""
    if not cuda:
        return ()
    return tuple((d, torch.cuda.get_rng_state(d)) for d in cuda_devices(tensors))


@contextlib.contextmanager
def replayed(cpu: torch.Tensor | None, cuda: CudaStates) -> Iterator[None]:
    """Sets the CPU generator to ``cpu`` (unless None) and each CUDA one to its state in ``cuda``
    for the block, then back to where they stood before it."""
    cpu_now = torch.get_rng_state()
    cuda_now = [(d, torch.cuda.get_rng_state(d)) for d, _ in cuda]
    try:
        if cpu is not None:
            torch.set_rng_state(cpu)
        for d, state in cuda:
            torch.cuda.set_rng_state(state, d)
        yield
    finally:
        torch.set_rng_state(cpu_now)
        for d, state in cuda_now:
            torch.cuda.set_rng_state(state, d)
