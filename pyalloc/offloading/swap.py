"""Host swap: reusable host buffers, and copies on a side stream per device.

Note [Copies on CUDA]
    Swap copies run on a side stream per device, so they overlap compute. A swap-out makes the
    side stream wait for the compute stream (the tensor must be written before it is read),
    copies into a pinned host buffer and records an event; the session keeps the device tensor
    until that event completes (:class:`Copy`), so its memory is not reused under the copy.
    Completed copies are reaped on later packs and unpacks and at step ends; the allocator's
    pressure callback waits for them, because it must return memory that is really free. A
    swap-in allocates on the compute stream, makes the side stream wait for it (the block may
    still be read by queued kernels), copies and records an event; the compute stream waits
    for that event only when the tensor is handed to autograd (``_unpack``), so a prefetch
    overlaps the backward nodes before it. Host buffers a copy reads or writes go back to the
    pool only when the copy is done. A swap-in requested while the tensor's swap-out is still
    in flight takes the device tensor back: no copy. On CPU every copy is synchronous.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .saved import SavedActivation


class HostBufferPool:
    """Reusable host buffers by power-of-two size class.

    Why: allocating pinned memory per tensor costs milliseconds (cudaHostAlloc), so swap buffers
    are kept and reused. Pinned only when CUDA is available; plain host memory otherwise.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.reserved_bytes = 0
        self.reuses = 0

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return 1 << max(12, (nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        cls = self._size_class(nbytes)
        bucket = self._free.get(cls)
        if bucket:
            self.reuses += 1
            return bucket.pop()
        buf = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin)
        self.reserved_bytes += cls
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
        self.reserved_bytes = 0


@dataclass(eq=False)
class Copy:
    """An asynchronous copy on a side stream, and what must outlive it; see Note [Copies on CUDA]."""

    event: Any  # torch.cuda.Event recorded on the side stream after the copy
    keep: torch.Tensor | None  # the device tensor the copy reads or writes; None once done
    bufs: list[torch.Tensor]  # host buffers to return to the pool once done
    nbytes: int


def wait_for_copies(inflight: "collections.deque[Copy]") -> None:
    """At a session's collection: copies still in flight must finish before what they hold is
    freed (a swap-in writes into device memory the allocator would hand out again)."""
    for copy in inflight:
        with contextlib.suppress(Exception):
            copy.event.synchronize()
    inflight.clear()


class HostSwap:
    """A session's host side: its buffer pool, the side-stream copies in flight (oldest first),
    and one side stream per device; see Note [Copies on CUDA]."""

    def __init__(self, pin: bool) -> None:
        self.pool = HostBufferPool(pin=pin)
        self._inflight: collections.deque[Copy] = collections.deque()  # in issue order
        self._side_streams: dict[int, Any] = {}  # device index -> torch.cuda.Stream
        weakref.finalize(self, wait_for_copies, self._inflight)

    def __len__(self) -> int:
        """Copies in flight."""
        return len(self._inflight)

    def track(self, copy: Copy) -> None:
        """Keeps what ``copy`` reads or writes until its event completes."""
        self._inflight.append(copy)

    def reap(self, wait: bool) -> None:
        """Releases what finished side-stream copies held; ``wait``: all of them, blocking.

        Stops at the first unfinished copy: copies on one stream finish in issue order.
        """
        while self._inflight:
            copy = self._inflight[0]
            if wait:
                copy.event.synchronize()
            elif not copy.event.query():
                return
            self._inflight.popleft()
            copy.keep = None
            bufs, copy.bufs = copy.bufs, []
            for buf in bufs:
                self.pool.release(buf)

    def release_host(self, h: "SavedActivation") -> None:
        """Returns ``h``'s host buffer to the pool, or to its swap-out copy while that runs."""
        if h.host is None:
            return
        if h.pending is not None and h.pending.keep is not None:
            h.pending.bufs.append(h.host)
        else:
            self.pool.release(h.host)
        h.host = None
        h.pending = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> Any:
        """Copies ``src`` into ``dst`` on the device's side stream, after the work already queued
        on the current stream; returns the event recorded after the copy."""
        side = self._side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def _side_stream(self, device: torch.device) -> Any:
        """The side stream for swap copies on ``device``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side_streams.get(index)
        if stream is None:
            stream = self._side_streams[index] = torch.cuda.Stream(device=index)
        return stream
