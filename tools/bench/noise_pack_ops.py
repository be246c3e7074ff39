#!/usr/bin/env python3
"""What keeping a CPU dropout noise as a mask costs, operation by operation (Note [Packed noise]
in pyalloc/offloading/dropout.py), beside drawing the noise again: milliseconds per call for a
noise of ``--mib`` MiB, one thread.

    python3 tools/bench/noise_pack_ops.py [--mib 2] [--reps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from pyalloc.offloading.dropout import pack_noise, unpack_noise


def _ms(f: Callable[[], object], reps: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps * 1e3


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
    rows = {
        "mask (t.bool())": _ms(lambda: noise.bool(), args.reps),
        "scale (t.amax())": _ms(lambda: noise.amax(), args.reps),
        "unpack (unpack_noise)": _ms(lambda: unpack_noise(mask, scale), args.reps),
        "unpack with torch.mul(mask, scale)": _ms(lambda: torch.mul(mask, scale), args.reps),
        "check with torch.equal": _ms(lambda: torch.equal(unpack_noise(mask, scale), noise), args.reps),
        "a pack (pack_noise: mask, scale, unpack, check)": _ms(lambda: pack_noise(noise), args.reps),
        "drawing the noise again (bernoulli_, div_)": _ms(lambda: torch.empty(n).bernoulli_(0.9).div_(0.9), args.reps),
    }
    if args.json:
        print(json.dumps({"mib": args.mib, "ms": rows}, indent=2))
    else:
        for name, ms in rows.items():
            print(f"{name:<50} {ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
