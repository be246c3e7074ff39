"""The activation offload manager: swap and recompute of saved activations under pressure.

What lives here: the session behind ``pyalloc.offload`` (``session``: ActivationOffload), the
planned policy (``plan``: the profiled step, the greedy planner and the plan search, Note
[Planned recompute]; ``regions``: a step run under a plan, module re-runs; ``ops``: the aten
operators of the profiled step and selective re-runs, Note [Selective re-runs]; ``batchnorm``: batch-norm
outputs refilled from their saved statistics, Note [Batch-norm refills]; ``dropout``: dropout outputs
refilled from their saved noise, Note [Dropout refills]; ``refills``: the two kinds behind one call), the clock its costs are measured with (``clock``, Note [Device time]), the torch calls DTR
records and replays (``calls``, Note [Producers and replay]; ``args``: taking call arguments
apart), the DTR cost model (``cost``, Note [Free neighbours]), host swap (``swap``: host buffers
and side-stream copies, Note [Copies on CUDA]), DTR's saved-activation handle (``saved``), the
generator states re-runs replay (``rng``, Note [Generator states]), the debug check of recomputed
tensors (``check``, Note [Recompute check]), the process-wide session of ``pyalloc run --offload`` (``process``), and the offload benchmark's
models and step (``bench_models``: what ``tools/bench/offload_bench.py`` and the offload check of
``pyalloc gpu-check`` run).

Named ``offloading``, not ``offload``: ``pyalloc.offload`` is the public function, and a
subpackage of that name would replace it as an attribute of ``pyalloc`` once imported.

May import: torch, the core binding (``pyalloc.core``: pressure callbacks, free neighbours,
stats), ``pyalloc.pytorch`` (whether pyalloc is PyTorch's allocator).

Must never come here: trace tooling or gpumemd. Nothing in the core binding imports this
package: the facade does so lazily, and the session's figures reach ``memory_stats()`` through
``pyalloc.core.add_stats_source``.
"""
