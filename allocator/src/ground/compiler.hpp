// compiler.hpp: branch hints and forced inlining for the fast path.
#pragma once

#define PYALLOC_LIKELY(x) __builtin_expect(!!(x), 1)
#define PYALLOC_UNLIKELY(x) __builtin_expect(!!(x), 0)
// The fast path's pieces are written as functions for reading, and inlined.
#define PYALLOC_INLINE inline __attribute__((always_inline))
