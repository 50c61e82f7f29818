// Optional x86 SIMD inner loops for the CPU gather, chosen at run time.
//
// Compiled with per-function target attributes (no global -mavx512f), so the extension
// still runs on any x86-64 (or non-x86) CPU; callers fall back to scalar loops when
// pick_gather_segment() returns nullptr.
#pragma once

#include <cstdint>

namespace elastic_plugin::simd {

// dst[j] = src[idx[j]] for j < count, elements of a fixed size; every idx[j] is in [0, n).
// Meanwhile prefetches prefetch_bytes starting at `prefetch` (the next row to be
// gathered; nullptr for none), so its cache lines arrive before the random reads do.
using GatherSegmentFn = void (*)(void* dst, const void* src, const int32_t* idx, int64_t count, int64_t n,
                                 const char* prefetch, int64_t prefetch_bytes);

// The vectorized segment gather for this element size on this CPU, or nullptr.
GatherSegmentFn pick_gather_segment(int64_t elem_size);

}  // namespace elastic_plugin::simd
