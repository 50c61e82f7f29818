// The CPU row copy shared by ordered_gather (gather_cpu.cpp) and ordered_gather_many
// (gather_many.cpp): output rows [begin, end) of one gather, where output row
// r = o * k + j holds kept position j of outer index o.
//
// Data are moved as raw units of the element size (T is an unsigned type of that size),
// so every dtype torch can copy works without a dtype switch.
#pragma once

#include "cpu_simd.h"
#include "ordered_gather.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace elastic_plugin::cpu {

// 16-byte element (complex128) copied as two 8-byte words.
struct alignas(8) Bytes16 {
  uint64_t lo, hi;
};

// Bytes of one kept row copied at a time on the strided-row path.
constexpr int64_t kStridedTileBytes = 128;

// Rows ahead to prefetch on the last-dim path.  Its reads are random within a row, so
// the hardware prefetcher cannot help; fetching the next rows' lines early halves the
// time (4096x4096 fp32, 50% of columns: 13 ms -> 6.5 ms single-threaded).
constexpr int64_t kPrefetchRows = 2;

// dst[j] = src[idx[j]] for j < count, while prefetching prefetch_bytes at `prefetch`.
template <typename T>
inline void gather_segment(T* __restrict__ dst, const T* __restrict__ src, const int64_t* __restrict__ idx,
                           int64_t count, const char* prefetch, int64_t prefetch_bytes) {
  const int64_t lines = prefetch ? (prefetch_bytes + 63) / 64 : 0;
  const int64_t step = lines > 0 ? std::max<int64_t>(1, count / lines) : std::max<int64_t>(count, 1);
  int64_t j = 0;
  int64_t line = 0;
  while (j < count) {
    if (line < lines) __builtin_prefetch(prefetch + 64 * line++);
    const int64_t stop = std::min(count, j + step);
    for (; j < stop; ++j) dst[j] = src[idx[j]];
  }
  for (; line < lines; ++line) __builtin_prefetch(prefetch + 64 * line);
}

// Copies output rows [begin, end) of the gather planned by `p` from src into out.
// `idx32` (int32 copy of perm[:k]) and `simd_fn` serve the last-dim hardware gather;
// pass nullptr for both when it is not used.
template <typename T>
inline void copy_kept_rows(const GatherPlan& p, const T* src, T* out, const int64_t* perm, const int32_t* idx32,
                           simd::GatherSegmentFn simd_fn, int64_t begin, int64_t end) {
  const int64_t* outer_tab = p.outer_table.defined() ? p.outer_table.const_data_ptr<int64_t>() : nullptr;
  const int64_t* inner_tab = p.inner_table.defined() ? p.inner_table.const_data_ptr<int64_t>() : nullptr;
  const int64_t inner = p.inner;
  const int64_t row_bytes = inner * static_cast<int64_t>(sizeof(T));
  const auto outer_offset = [&](int64_t o) { return outer_tab ? outer_tab[o] : o * p.outer_stride; };

  int64_t o = begin / p.k;
  int64_t j = begin - o * p.k;
  int64_t r = begin;
  while (r < end) {
    const int64_t j_end = std::min(p.k, j + (end - r));
    const T* base = src + outer_offset(o);
    T* dst = out + r * inner;
    if (inner == 1 && p.dim_stride == 1) {
      // Gathering along the last (collapsed) dim of dense rows: one element per kept entry.
      const char* next = o + kPrefetchRows < p.outer
                             ? reinterpret_cast<const char*>(src + outer_offset(o + kPrefetchRows))
                             : nullptr;
      const int64_t next_bytes = p.n * static_cast<int64_t>(sizeof(T));
      if (simd_fn != nullptr && idx32 != nullptr) {
        simd_fn(dst, base, idx32 + j, j_end - j, p.n, next, next_bytes);
      } else {
        gather_segment(dst, base, perm + j, j_end - j, next, next_bytes);
      }
    } else if (inner == 1) {
      for (int64_t jj = j; jj < j_end; ++jj) dst[jj - j] = base[perm[jj] * p.dim_stride];
    } else if (p.inner_contiguous()) {
      for (int64_t jj = j; jj < j_end; ++jj, dst += inner) {
        std::memcpy(dst, base + perm[jj] * p.dim_stride, row_bytes);
      }
    } else {
      // Strided rows (e.g. src = w.t(), whose gathered dim is the dense one). Kept rows are
      // visited in increasing source position, so consecutive ones read neighbouring elements
      // of the same cache lines while those are in L1 (in importance order they would jump
      // between lines, and every read would go to L2: 2x slower on 4096x4096 bf16). Tiles of
      // kStridedTileBytes per kept row keep every output line written whole.
      constexpr int64_t tile = std::max<int64_t>(8, kStridedTileBytes / static_cast<int64_t>(sizeof(T)));
      const int64_t si = p.inner_stride;
      std::vector<int64_t> order(j_end - j);
      std::iota(order.begin(), order.end(), j);
      std::sort(order.begin(), order.end(), [perm](int64_t a, int64_t b) { return perm[a] < perm[b]; });
      for (int64_t i0 = 0; i0 < inner; i0 += tile) {
        const int64_t i1 = std::min(inner, i0 + tile);
        for (const int64_t jj : order) {
          T* d = dst + (jj - j) * inner + i0;
          const T* row = base + perm[jj] * p.dim_stride;
          if (inner_tab) {
            for (int64_t i = i0; i < i1; ++i) d[i - i0] = row[inner_tab[i]];
          } else {
            for (int64_t i = i0; i < i1; ++i) d[i - i0] = row[i * si];
          }
        }
      }
    }
    r += j_end - j;
    j = j_end;
    if (j == p.k) {
      j = 0;
      ++o;
    }
  }
}

}  // namespace elastic_plugin::cpu
