"""Generated adversarial allocation patterns for the fragmentation stress suite.

Recorded workloads show how real models behave; these show where a caching
allocator breaks. Each generator returns a :class:`pyalloc.traces.trace.Trace`
built from trace-format JSON lines through :func:`pyalloc.traces.trace.parse_lines`,
so a generated trace passes exactly the validation a recorded one does. Each
is deterministic given its seed (``random.Random(seed)``, no global state),
marks iteration boundaries with ``{"op": "mark", "name": "iteration"}``, and
peaks at several hundred MiB to a few GiB of live bytes: they are meant to
replay on the sim backend at GPU scale (80 GiB by default).

The size thresholds they cross are those of both policies under comparison
(``device_allocator.hpp``, ``native_model.hpp``): requests up to 1 MiB come
from 2 MiB small-pool segments, 1-10 MiB from 20 MiB segments, larger ones
from a segment of their own rounded up to 2 MiB.

``quick=True`` (via :func:`generate`) picks smaller loops of the same shape,
for tests and smoke runs.
"""

from __future__ import annotations

import json
import random
from typing import Callable

from .trace import Trace, parse_lines

KiB = 1 << 10
MiB = 1 << 20


class TraceBuilder:
    """Collects events as trace-format JSON lines, then validates them into a Trace.

    Ids are handed out densely and never reused, so a generator cannot make
    the "alloc of a live id" mistake; a free of a dead id would still be
    caught by :func:`parse_lines`.
    """

    def __init__(self, source: str, device_capacity: int = 80 << 30) -> None:
        header = {"version": 1, "source": source, "device_capacity": device_capacity}
        self._lines: list[str] = [json.dumps(header)]
        self._next_id = 0
        self._t = 0

    def alloc(self, size: int, stream: int = 0) -> int:
        ident = self._next_id
        self._next_id += 1
        self._emit({"op": "alloc", "id": ident, "size": int(size), "stream": stream})
        return ident

    def free(self, ident: int, stream: int = 0) -> None:
        self._emit({"op": "free", "id": ident, "stream": stream})

    def mark(self, name: str = "iteration") -> None:
        self._emit({"op": "mark", "name": name})

    def _emit(self, event: dict[str, object]) -> None:
        event["t"] = self._t
        self._t += 1
        self._lines.append(json.dumps(event))

    def build(self, name: str) -> Trace:
        return parse_lines(self._lines, name)


def batch_growth(seed: int = 0, iterations: int = 48, start_batch: int = 8, layers: int = 8,
                 seq: int = 128, hidden: int = 1024) -> Trace:
    """A training loop whose batch grows by one sample every iteration (N, N+1, N+2, ...).

    Targets: exact-size reuse. A caching allocator is fast and tight when
    iteration k+1 asks for the sizes iteration k freed. Here every activation,
    attention score, MLP intermediate and gradient is a little larger than the
    block cached for it one step earlier, so no cached block fits exactly:
    each request either splits a larger cached block (leaving slivers too small
    for the next, larger request) or grows a new segment, and reserved memory
    ratchets up far beyond the peak of live bytes. Sizes also walk across the
    1 MiB and 10 MiB segment-class thresholds as the batch grows. This is the
    pattern PyTorch's ``expandable_segments`` was introduced for.

    Shape: persistent weights and Adam state; per layer a forward that saves
    activations (x, attention scores, MLP intermediate, small norm statistics)
    and frees a workspace; a backward in reverse that frees them; weight
    gradients made once and kept; an optimizer step with short temporaries.
    The seed adds small, randomly placed temporaries (metrics, masks).
    """
    rng = random.Random(seed)
    b = TraceBuilder(f"generated: batch_growth seed={seed}, batch {start_batch}..{start_batch + iterations - 1}")
    weight = hidden * hidden * 4
    weights = [b.alloc(weight) for _ in range(layers)]
    adam = [b.alloc(weight) for _ in range(2 * layers)]  # exp_avg, exp_avg_sq
    grads: list[int] = []
    heads = 8
    for it in range(iterations):
        batch = start_batch + it
        x_size = batch * seq * hidden * 4
        attn_size = batch * heads * seq * seq * 4
        ffn_size = 4 * x_size
        stats_size = batch * seq * 4 * 2
        tokens = b.alloc(batch * seq * 8)
        saved: list[list[int]] = []
        for _ in range(layers):
            layer = [b.alloc(x_size), b.alloc(attn_size), b.alloc(stats_size)]
            workspace = b.alloc(ffn_size)  # the pre-activation, freed once the activation exists
            layer.append(b.alloc(ffn_size))
            b.free(workspace)
            if rng.random() < 0.3:  # a dropout mask or metric that lives a moment
                b.free(b.alloc(rng.randrange(4 * KiB, 256 * KiB, 512)))
            saved.append(layer)
        loss = b.alloc(512)
        grad_out = b.alloc(x_size)
        for layer_index in reversed(range(layers)):
            grad_ffn = b.alloc(ffn_size)
            grad_in = b.alloc(x_size)
            if it == 0:
                grads.append(b.alloc(weight))
            else:
                scratch = b.alloc(weight)  # the gradient of this step before accumulation
                b.free(scratch)
            b.free(grad_ffn)
            for ident in reversed(saved[layer_index]):
                b.free(ident)
            b.free(grad_out)
            grad_out = grad_in
        b.free(grad_out)
        b.free(loss)
        b.free(tokens)
        for _ in range(layers):  # optimizer step: one temporary per parameter
            b.free(b.alloc(weight))
        b.mark("iteration")
    for ident in grads + adam + weights:
        b.free(ident)
    return b.build("batch_growth")


def interleaved_lifetimes(seed: int = 0, steps: int = 3000, long_every: int = 4,
                          long_lifetime: tuple[int, int] = (150, 600), steps_per_iteration: int = 50) -> Trace:
    """Short-lived and long-lived allocations interleaved, so long ones pin segments.

    Targets: segment pinning. Every step makes a short-lived buffer (2-48 MiB,
    freed 1-3 steps later); every few steps a long-lived one (1-8 MiB, living
    hundreds of steps, like a KV-cache page or a checkpointed activation) is
    made in between. Best fit places the long-lived block in whatever free
    block a short-lived one just left, splitting it; that segment can then
    never be returned or coalesced into a range big enough for the next
    large short-lived request, which needs fresh memory. Reserved memory grows
    with the number of pinned segments, not with live bytes.
    """
    rng = random.Random(seed)
    b = TraceBuilder(f"generated: interleaved_lifetimes seed={seed}, {steps} steps")
    short_live: list[tuple[int, int]] = []  # (free at step, id)
    long_live: list[tuple[int, int]] = []
    for step in range(steps):
        for queue in (short_live, long_live):
            due = [ident for when, ident in queue if when <= step]
            queue[:] = [(when, ident) for when, ident in queue if when > step]
            for ident in due:
                b.free(ident)
        short_live.append((step + rng.randint(1, 3), b.alloc(rng.randrange(2 * MiB, 48 * MiB, 512))))
        if rng.random() < 0.15:  # a small short-lived tensor, from the small pool
            short_live.append((step + 1, b.alloc(rng.randrange(512, 1 * MiB, 512))))
        if step % long_every == long_every - 1:
            lifetime = rng.randint(*long_lifetime)
            long_live.append((step + lifetime, b.alloc(rng.randrange(1 * MiB, 8 * MiB, 512))))
        if step % steps_per_iteration == steps_per_iteration - 1:
            b.mark("iteration")
    for _, ident in short_live + long_live:
        b.free(ident)
    return b.build("interleaved_lifetimes")


def size_sweep(seed: int = 0, sweeps: int = 6, points: int = 40, per_point: int = 4, window: int = 6,
               smallest: int = 256 * KiB, largest: int = 48 * MiB) -> Trace:
    """Sizes sweeping up from 256 KiB to 48 MiB and back down, across the 1 MiB and 10 MiB thresholds.

    Targets: memory stranded in the wrong size class. On the way up, the
    small pool (2 MiB segments) and the 20 MiB segments of the 1-10 MiB class
    fill with cached blocks that the large requests that follow cannot use;
    on the way down, large cached blocks are split to serve smaller requests,
    and the small-pool and mid-class memory cached earlier is only reused if
    it happens to fit. A policy that keeps classes apart reserves close to the
    sum of the per-class peaks rather than the peak of the sum. Each sweep (up
    and down) is one iteration; a window of the last few sizes stays live.
    The seed jitters every size by up to +-3%.
    """
    rng = random.Random(seed)
    b = TraceBuilder(f"generated: size_sweep seed={seed}, {sweeps} sweeps {smallest}..{largest} B")
    ratio = (largest / smallest) ** (1 / (points - 1))
    up = [smallest * ratio**i for i in range(points)]
    live: list[list[int]] = []
    for _ in range(sweeps):
        for size in up + up[-2:0:-1]:
            group = []
            for _ in range(per_point):
                jittered = int(size * rng.uniform(0.97, 1.03)) // 512 * 512
                group.append(b.alloc(max(512, jittered)))
            live.append(group)
            if len(live) > window:
                for ident in live.pop(0):
                    b.free(ident)
        b.mark("iteration")
    for group in live:
        for ident in group:
            b.free(ident)
    return b.build("size_sweep")


PRODUCER_STREAM = 1
CONSUMER_STREAM = 2


def two_stream(seed: int = 0, steps: int = 2000, queue_depth: int = 4, steps_per_iteration: int = 40) -> Trace:
    """A producer on stream 1 hands buffers to a consumer on stream 2, which frees them there.

    Targets: per-stream caching. A block is cached for the stream it was
    allocated on, whichever stream frees it, so the producer's buffers (1-24
    MiB, allocated on stream 1, freed on stream 2 once consumed, a few steps
    later) return to stream 1's cache, where the consumer's own allocations
    (2-32 MiB workspaces and outputs on stream 2, living 1-6 steps, some much
    longer) can never use them, and vice versa. Reserved memory approaches the
    sum of the two streams' peaks rather than the peak of their sum. (On a
    real device a cross-stream free must also wait for an event before reuse;
    in a replay events complete at once, so only the split caches show.)
    """
    rng = random.Random(seed)
    b = TraceBuilder(f"generated: two_stream seed={seed}, {steps} steps, queue depth {queue_depth}")
    queue: list[int] = []
    consumer_live: list[tuple[int, int]] = []
    for step in range(steps):
        queue.append(b.alloc(rng.randrange(1 * MiB, 24 * MiB, 512), PRODUCER_STREAM))
        if len(queue) > queue_depth:
            batch = queue.pop(0)
            for _ in range(rng.randint(1, 3)):
                lifetime = rng.randint(1, 6) if rng.random() < 0.9 else rng.randint(50, 200)
                consumer_live.append((step + lifetime, b.alloc(rng.randrange(2 * MiB, 32 * MiB, 512), CONSUMER_STREAM)))
            b.free(batch, CONSUMER_STREAM)  # consumed: freed on the consumer's stream
        due = [ident for when, ident in consumer_live if when <= step]
        consumer_live = [(when, ident) for when, ident in consumer_live if when > step]
        for ident in due:
            b.free(ident, CONSUMER_STREAM)
        if step % steps_per_iteration == steps_per_iteration - 1:
            b.mark("iteration")
    for ident in queue:
        b.free(ident, CONSUMER_STREAM)
    for _, ident in consumer_live:
        b.free(ident, CONSUMER_STREAM)
    return b.build("two_stream")


Generator = Callable[..., Trace]

# name -> (generator, keyword arguments for a quick run of the same shape)
GENERATORS: dict[str, tuple[Generator, dict[str, int]]] = {
    "batch_growth": (batch_growth, {"iterations": 12}),
    "interleaved_lifetimes": (interleaved_lifetimes, {"steps": 600}),
    "size_sweep": (size_sweep, {"sweeps": 2}),
    "two_stream": (two_stream, {"steps": 400}),
}


def generate(name: str, seed: int = 0, quick: bool = False) -> Trace:
    """The generated workload ``name``; ``quick`` picks its smaller variant."""
    if name not in GENERATORS:
        raise KeyError(f"unknown generated workload {name!r} (known: {', '.join(GENERATORS)})")
    function, quick_kwargs = GENERATORS[name]
    return function(seed=seed, **(quick_kwargs if quick else {}))
