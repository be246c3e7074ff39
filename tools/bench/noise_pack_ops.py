#!/usr/bin/env python3
"""What keeping a CPU dropout noise as a mask costs, operation by operation (Note [Packed noise]
in pyalloc/offloading/dropout.py), beside drawing the noise again: milliseconds per call for a
noise of ``--mib`` MiB, one thread, with the caches warm (the same noise again and again) and cold
(a 32 MiB buffer written before each call, as a training step leaves them).

    python3 tools/bench/noise_pack_ops.py [--mib 2] [--reps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from pyalloc.offloading.dropout import _same_bits, pack_noise, unpack_noise


def _ms(f: Callable[[], object], reps: int, flush: torch.Tensor | None = None) -> float:
    """Milliseconds a call of ``f``; with ``flush``, each call after writing that buffer (the
    caches cold, as in a training step, where the noise was made long before it is packed)."""
    f()
    total = 0.0
    for _ in range(reps):
        if flush is not None:
            flush.add_(1)
        start = time.perf_counter()
        f()
        total += time.perf_counter() - start
    return total / reps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.mib <= 0 or args.reps < 1:
        parser.error("--mib must be above 0 and --reps at least 1")
    torch.set_num_threads(1)
    n = int(args.mib * (1 << 20)) // 4
    noise = torch.empty(n).bernoulli_(0.9).div_(0.9)
    packed = pack_noise(noise)
    assert packed is not None
    mask, scale = packed
    def unpack_and_compare() -> object:  # how 3d17d3a checked a pack (NumPy's comparison of the bits)
        return _same_bits(unpack_noise(mask, scale), noise)

    ops: dict[str, Callable[[], object]] = {
        "mask (t.bool())": lambda: noise.bool(),
        "scale (t.amax())": lambda: noise.amax(),
        "unpack (unpack_noise)": lambda: unpack_noise(mask, scale),
        "unpack with torch.mul(mask, scale)": lambda: torch.mul(mask, scale),
        "check by unpacking and comparing": unpack_and_compare,
        "a pack (pack_noise: counted, no copy)": lambda: pack_noise(noise),
        "a pack as 3d17d3a (amax, bool, unpack, compare)": lambda: (noise.amax(), noise.bool(), unpack_and_compare()),
        "drawing the noise again (bernoulli_, div_)": lambda: torch.empty(n).bernoulli_(0.9).div_(0.9),
    }
    flush = torch.empty(32 << 20, dtype=torch.uint8)  # beyond the last-level cache of most machines
    rows = {name: {"hot": _ms(f, args.reps), "cold": _ms(f, args.reps, flush)} for name, f in ops.items()}
    if args.json:
        print(json.dumps({"mib": args.mib, "ms": rows}, indent=2))
    else:
        print(f"{'':<50} {'hot':>8}    {'cold':>8}")
        for name, ms in rows.items():
            print(f"{name:<50} {ms['hot']:8.3f} ms {ms['cold']:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
