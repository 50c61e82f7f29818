// Importance-ordered gather: keep the first k entries of a permutation along one dim.
//
//   ordered_gather(src, perm, k, dim) == src.index_select(dim, perm[:k]).contiguous()
//
// Nested ("many-in-one") models keep every smaller width as a prefix of an importance
// ranking, so reordering and slicing weights is one gather of a permutation prefix.
// This header holds what the CPU and CUDA kernels share: argument checks and the
// strided "plan" that views src as [outer, n, inner] without copying it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace elastic_plugin {

// src seen as [outer, n, inner] around `dim`, in elements (not bytes).
// Dims before `dim` collapse into one "outer" index and dims after it into one
// "inner" index.  When they cannot collapse to a single stride (some non-contiguous
// views), an int64 offset table on src's device maps the index to an element offset.
struct GatherPlan {
  int64_t outer = 1;         // product of the sizes before dim
  int64_t n = 0;             // src.size(dim): valid perm values are [0, n)
  int64_t k = 0;             // number of kept entries
  int64_t inner = 1;         // product of the sizes after dim
  int64_t outer_stride = 0;  // element stride of the outer index (no outer_table)
  int64_t dim_stride = 0;    // element stride of dim
  int64_t inner_stride = 1;  // element stride of the inner index (no inner_table)
  at::Tensor outer_table;    // int64 offsets, or undefined when one stride suffices
  at::Tensor inner_table;    // int64 offsets, or undefined when one stride suffices

  // True when each kept row (inner elements) is one contiguous run of memory.
  bool inner_contiguous() const {
    return !inner_table.defined() && (inner == 1 || inner_stride == 1);
  }
  int64_t out_numel() const { return outer * k * inner; }
};

// Validates the arguments (TypeError / ValueError naming the argument) and
// returns dim normalized to [0, src.dim()).  Checks metadata only, never values.
int64_t check_gather_args(const at::Tensor& src, const at::Tensor& perm, int64_t k, int64_t dim);

// Throws a ValueError naming perm when min/max of perm[:k] fall outside [0, n).
void check_perm_range(int64_t min_value, int64_t max_value, int64_t n);

// The strided plan of src around `dim` (dim already normalized).
GatherPlan make_gather_plan(const at::Tensor& src, int64_t dim, int64_t k);

// A contiguous tensor shaped like src with size k at `dim`.
at::Tensor empty_gather_output(const at::Tensor& src, int64_t dim, int64_t k);

// src without lazy conjugate/negative bits, so kernels may copy raw bytes.
at::Tensor resolve_lazy_bits(const at::Tensor& src);

}  // namespace elastic_plugin
