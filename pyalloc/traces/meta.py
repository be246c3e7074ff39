"""`pyalloc record --meta`: allocation traces of GPU-scale training steps, recorded with no memory.

Note [Meta recordings]
~~~~~~~~~~~~~~~~~~~~~~
A model built on PyTorch's meta device runs every operator on shapes alone,
so a training step of a 7B-parameter model takes a second and no memory. A
TorchDispatchMode (StorageRecorder) sees every operator's outputs: an output
whose storage it has not seen is an allocation of that storage's bytes, in
the order the operators ran (parameters when the model is built, activations
in forward, gradients in backward, optimizer state at the first step). The
free is the storage's death: a weak reference to the UntypedStorage fires
its callback when the storage goes (its Python object lives exactly as long
as the storage, as torch.distributed's MemTracker relies on too). Views
share their base's storage and allocate nothing; in-place operators and
``out=`` likewise. A tensor on the CPU is none of the device's: AdamW's
``step`` counters are made there (``device="cpu"`` unless capturable), and
until 2026-11-29 each was recorded as a device allocation of 4 bytes (201
to 296 in the shipped GPU-scale traces, which were recorded so: up to 30 MiB
of reserved memory on llama7b_b1_s2048 once rounded, the minimum capacity
unchanged).

What a CUDA run allocates that a meta run does not is modelled, and the
trace's `source` says how (CudaExtras):
  - the cuBLAS workspace: 32 MiB (PyTorch's default on sm90:
    ``parseChosenWorkspaceSize``, ``:4096:8``), allocated through the
    caching allocator at the first matrix multiply and kept for good;
  - flash attention's backward scratch: a float32 accumulator of dq and
    the softmax row sums, allocated around each backward call;
  - cuDNN's convolution workspaces: an estimate, not a measurement: the
    larger of the input and the output, at most 256 MiB, allocated around
    each convolution, forward and backward.
Not modelled: cuBLASLt's own workspace, NCCL buffers and DDP gradient
buckets (single-process traces), the CUDA context (not the allocator's).
"""

from __future__ import annotations

import argparse
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .generators import TraceBuilder
from .meta_models import MODELS, MetaConfig
from .trace import Trace

MiB = 1 << 20
GiB = 1 << 30
H100_CAPACITY = 80 * GiB

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "addbmm", "_int_mm"}
_CONVOLUTIONS = {"convolution", "convolution_backward", "cudnn_convolution", "cudnn_convolution_transpose"}
_FLASH_BACKWARD = "_scaled_dot_product_flash_attention_backward"


@dataclass(frozen=True)
class CudaExtras:
    """Allocations a CUDA run makes that the meta device does not (Note [Meta recordings])."""

    cublas_workspace: int = 32 * MiB
    cudnn_workspace_cap: int = 256 * MiB
    flash_backward_scratch: bool = True

    def describe(self) -> str:
        parts = []
        if self.cublas_workspace:
            parts.append(f"the cuBLAS workspace ({self.cublas_workspace // MiB} MiB, PyTorch's default on sm90, "
                         "at the first matrix multiply, kept)")
        if self.flash_backward_scratch:
            parts.append("flash attention's backward scratch (an fp32 dq accumulator and the softmax row sums, "
                         "around each backward call)")
        if self.cudnn_workspace_cap:
            parts.append(f"cuDNN convolution workspaces (an estimate: the larger of input and output, at most "
                         f"{self.cudnn_workspace_cap // MiB} MiB, around each convolution)")
        return "; ".join(parts) if parts else "none"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StorageRecorder(TorchDispatchMode):
    """Writes every storage that operators create, and its death, into a TraceBuilder."""

    def __init__(self, builder: TraceBuilder, extras: CudaExtras) -> None:
        super().__init__()
        self.builder = builder
        self.extras = extras
        self._live: dict[int, tuple[int, weakref.ref[Any]]] = {}  # storage address -> (trace id, weakref)
        self._cublas_done = False
        self.live_bytes = 0
        self.peak_bytes = 0

    # ---- storages ------------------------------------------------------------------------

    def _alloc(self, size: int) -> int:
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return self.builder.alloc(size)

    def _free(self, ident: int, size: int) -> None:
        self.live_bytes -= size
        self.builder.free(ident)

    def _died(self, key: int, ident: int, size: int, _ref: object) -> None:
        if self._live.pop(key, None) is not None:
            self._free(ident, size)

    def note(self, t: torch.Tensor) -> None:
        if t.device.type == "cpu":  # not the device's memory (Note [Meta recordings])
            return
        storage = t.untyped_storage()
        key = storage._cdata
        size = storage.nbytes()
        if key in self._live or size == 0:
            return
        ident = self._alloc(size)
        self._live[key] = (ident, weakref.ref(storage, functools.partial(self._died, key, ident, size)))

    def close(self) -> None:
        """Stops listening: storages alive now stay allocated in the trace."""
        self._live.clear()

    # ---- operators ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        name = func.overloadpacket.__name__
        scratch = self._scratch_before(name, args)
        if name in _MATMULS and not self._cublas_done and self.extras.cublas_workspace:
            self._cublas_done = True
            self._alloc(self.extras.cublas_workspace)  # kept for the process's life, never freed
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.note(t)
        if scratch:
            self._free(*scratch)
        return out

    def _scratch_before(self, name: str, args: tuple[Any, ...]) -> tuple[int, int] | None:
        size = 0
        if name == _FLASH_BACKWARD and self.extras.flash_backward_scratch:
            q = args[1]  # (grad_out, query, key, value, out, logsumexp, ...): query is (B, H, T, D)
            b, h, t, d = q.shape
            size = b * h * t * 4 + b * h * t * d * 4
        elif name in _CONVOLUTIONS and self.extras.cudnn_workspace_cap:
            tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
            size = min(self.extras.cudnn_workspace_cap, max((_nbytes(a) for a in tensors), default=0))
        if size <= 0:
            return None
        return self._alloc(size), size


@dataclass
class MetaRecording:
    name: str
    trace: Trace
    source: str
    seconds: float
    peak_live_bytes: int


def default_name(model: str, batch: int, seq: int, use_checkpoint: bool) -> str:
    return f"{model}_b{batch}_s{seq}{'_ckpt' if use_checkpoint else ''}"


def record_meta(model: str, steps: int = 3, batch: int | None = None, seq: int | None = None,
                use_checkpoint: bool = False, seed: int = 0, extras: CudaExtras | None = None,
                progress: Callable[[int], None] | None = None) -> MetaRecording:
    """Records `steps` training steps of a built-in GPU-scale model on the meta device."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r} for --meta (known: {', '.join(MODELS)})")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    spec = MODELS[model]
    cfg = MetaConfig(batch=spec.default_batch if batch is None else batch,
                     seq=spec.default_seq if seq is None else seq, checkpoint=use_checkpoint, seed=seed)
    if cfg.batch < 1 or cfg.seq < 1:
        raise ValueError(f"--batch and --seq must be at least 1, got {cfg.batch} and {cfg.seq}")
    extras = extras or CudaExtras()
    torch.manual_seed(seed)
    start = time.perf_counter()
    builder = TraceBuilder("meta", device_capacity=H100_CAPACITY)
    recorder = StorageRecorder(builder, extras)
    with recorder, torch.device("meta"):
        step = spec.build(cfg)
        for i in range(steps):
            step()
            builder.mark("iteration")
            if progress is not None:
                progress(i)
    recorder.close()
    seconds = time.perf_counter() - start
    shape = f"sequence {cfg.seq}" if model.startswith("llama") else f"images {cfg.seq}x{cfg.seq}"
    source = (f"{model}: {spec.description}; batch {cfg.batch}, {shape}; "
              f"{'activation checkpointing per layer (torch.utils.checkpoint, use_reentrant=False)' if cfg.checkpoint else 'no activation checkpointing'}; "
              f"bf16 parameters, gradients and optimizer state; {steps} training steps recorded on PyTorch's meta "
              f"device (pyalloc record --meta, torch {torch.__version__}): every storage an operator creates is an "
              f"allocation, freed when the storage dies; modelled CUDA allocations: {extras.describe()}; not "
              "modelled: cuBLASLt's workspace, NCCL and DDP buffers")
    name = default_name(model, cfg.batch, cfg.seq, cfg.checkpoint)
    trace = builder.build(name)
    trace.source = source
    return MetaRecording(name, trace, source, seconds, recorder.peak_bytes)


def run(args: argparse.Namespace) -> int:
    """`pyalloc record --meta MODEL`: called by record.run."""
    from pathlib import Path

    from ..command import UsageError
    from .record import _fail, _summary, output_problem, write_trace

    if args.from_snapshot is not None:  # (--device and --tiny: record._check_options)
        raise UsageError("record --meta records on the meta device: it takes no --device, --from-snapshot or --tiny")
    if args.model is None:
        raise UsageError(f"record --meta: name a MODEL ({', '.join(MODELS)})")
    if args.output is not None and (problem := output_problem(Path(args.output))) is not None:
        return _fail(problem)
    try:
        rec = record_meta(args.model, args.steps, args.batch, args.seq, args.checkpoint, args.seed)
    except (KeyError, ValueError) as e:
        raise UsageError(f"record --meta: {e.args[0]}") from None
    except RuntimeError as e:  # a size torch cannot represent (a batch of 10^14)
        return _fail(f"--meta {args.model}: torch could not build the step at this size: {str(e).splitlines()[0]}")
    output = Path(args.output) if args.output else Path(f"{rec.name}.jsonl.gz")
    if (problem := output_problem(output)) is not None:
        return _fail(problem)
    try:
        written = write_trace(rec.trace, output, rec.source, H100_CAPACITY)
    except OSError as e:
        return _fail(f"cannot write {output}: {e.strerror or e}")
    report = _summary(rec.trace, written)
    report["seconds"] = round(rec.seconds, 2)
    if args.json:
        import json

        print(json.dumps(report))
    else:
        print(f"{written}: {report['allocs']:,} allocs, {report['frees']:,} frees, {report['marks']} iteration "
              f"marks, peak live {report['peak_live_bytes'] / GiB:,.2f} GiB, recorded in {rec.seconds:.1f} s")
    return 0
