// CUDA kernel of ordered_gather.
//
// The output is contiguous, so it is written as a flat array of "units": 16, 8, 4, 2 or
// 1 bytes, the widest that keeps every row, stride and pointer aligned.  Each thread
// splits its flat index into (outer o, kept position j, unit i) with multiply-shift
// division and reads src[outer(o) + perm[j] * dim_stride + inner(i)].
//
// Only headers that exist in a bare CUDA toolkit are included (no cuBLAS/cuSPARSE),
// hence c10/cuda rather than ATen/cuda/CUDAContext.h.
#include "ordered_gather.h"

#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/stack.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

namespace elastic_plugin {
namespace {

// A 16-byte element (complex128) that may be only 8-byte aligned.
struct alignas(8) Bytes16 {
  uint64_t lo, hi;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // units per thread: independent loads in flight

// Strides and tables, all in units of U.
struct UnitPlan {
  int64_t n;             // valid perm values are [0, n)
  int64_t outer_stride;  // used when outer_table == nullptr
  int64_t dim_stride;
  int64_t inner_stride;  // used when inner_table == nullptr
  int64_t table_scale;   // units per element, for table entries (given in elements)
  const int64_t* outer_table;
  const int64_t* inner_table;
};

template <typename U, typename index_t>
__global__ void __launch_bounds__(kThreads)
    ordered_gather_kernel(U* __restrict__ out, const U* __restrict__ src,
                          const int64_t* __restrict__ perm, index_t total,
                          at::cuda::detail::IntDivider<index_t> inner_div,
                          at::cuda::detail::IntDivider<index_t> k_div, UnitPlan p) {
  const index_t first = static_cast<index_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  U values[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const index_t idx = first + u * kThreads;
    if (idx < total) {
      const auto row_unit = inner_div.divmod(idx);      // (row, unit in row)
      const auto outer_kept = k_div.divmod(row_unit.div);  // (outer, kept position)
      const int64_t entry = perm[outer_kept.mod];
      CUDA_KERNEL_ASSERT(entry >= 0 && entry < p.n);
      const int64_t o = static_cast<int64_t>(outer_kept.div);
      const int64_t i = static_cast<int64_t>(row_unit.mod);
      const int64_t offset = (p.outer_table ? p.outer_table[o] * p.table_scale : o * p.outer_stride) +
                             entry * p.dim_stride +
                             (p.inner_table ? p.inner_table[i] * p.table_scale : i * p.inner_stride);
      values[u] = src[offset];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const index_t idx = first + u * kThreads;
    if (idx < total) out[idx] = values[u];
  }
}

template <typename U, typename index_t>
void launch(const void* src, void* out, const int64_t* perm, int64_t total, int64_t inner_units,
            int64_t k, const UnitPlan& p, cudaStream_t stream) {
  const int64_t blocks = (total + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "ordered_gather: output too large (",
              total, " units)");
  ordered_gather_kernel<U, index_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      static_cast<U*>(out), static_cast<const U*>(src), perm, static_cast<index_t>(total),
      at::cuda::detail::IntDivider<index_t>(static_cast<index_t>(inner_units)),
      at::cuda::detail::IntDivider<index_t>(static_cast<index_t>(k)), p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename U>
void launch_any_index(const void* src, void* out, const int64_t* perm, int64_t total,
                      int64_t inner_units, int64_t k, const UnitPlan& p, cudaStream_t stream) {
  // 32-bit division is much cheaper on the GPU; offsets stay 64-bit either way.
  if (total <= std::numeric_limits<int32_t>::max()) {
    launch<U, uint32_t>(src, out, perm, total, inner_units, k, p, stream);
  } else {
    launch<U, uint64_t>(src, out, perm, total, inner_units, k, p, stream);
  }
}

// Widest power-of-two unit (<= 16 bytes) dividing every value in `byte_quantities`.
int64_t widest_unit(std::initializer_list<int64_t> byte_quantities) {
  int64_t unit = 16;
  for (int64_t q : byte_quantities) {
    while (unit > 1 && q % unit != 0) unit /= 2;
  }
  return unit;
}

// Host-side check of perm[:k]'s range: one small reduction and one sync.  Skipped while
// a CUDA graph is being captured (a sync is illegal there); the kernel still asserts.
void check_perm_range_cuda(const at::Tensor& kept, int64_t n) {
  if (kept.numel() == 0) return;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  const auto [lo, hi] = at::aminmax(kept);
  const at::Tensor both = at::stack({lo, hi}).cpu();
  const int64_t* v = both.const_data_ptr<int64_t>();
  check_perm_range(v[0], v[1], n);
}

at::Tensor ordered_gather_cuda(const at::Tensor& src_in, const at::Tensor& perm, int64_t k, int64_t dim) {
  const int64_t d = check_gather_args(src_in, perm, k, dim);
  const c10::cuda::CUDAGuard guard(src_in.device());
  const at::Tensor src = resolve_lazy_bits(src_in);
  const at::Tensor kept = perm.narrow(0, 0, k).contiguous();
  check_perm_range_cuda(kept, src.size(d));

  at::Tensor out = empty_gather_output(src, d, k);
  const GatherPlan plan = make_gather_plan(src, d, k);
  if (plan.out_numel() == 0) return out;

  const int64_t es = src.element_size();
  TORCH_CHECK_TYPE(es == 1 || es == 2 || es == 4 || es == 8 || es == 16,
                   "ordered_gather: unsupported element size ", es, " bytes (dtype ", src.scalar_type(), ")");
  const auto src_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src.const_data_ptr()));
  const auto out_addr = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out.data_ptr()));

  UnitPlan p{};
  p.n = plan.n;
  p.outer_table = plan.outer_table.defined() ? plan.outer_table.const_data_ptr<int64_t>() : nullptr;
  p.inner_table = plan.inner_table.defined() ? plan.inner_table.const_data_ptr<int64_t>() : nullptr;

  int64_t unit = es;
  int64_t inner_units = plan.inner;
  if (plan.inner_contiguous()) {
    // Rows are contiguous runs: copy them in the widest aligned unit.  Table entries
    // are element offsets, so with an outer table the unit must divide the element size.
    unit = widest_unit({plan.inner * es, plan.dim_stride * es, plan.outer_stride * es, src_addr,
                        out_addr, p.outer_table ? es : 16});
    inner_units = plan.inner * es / unit;
    p.inner_stride = 1;
  } else {
    // Strided rows: element by element (16-byte elements may be only 8-byte aligned).
    unit = es;
    p.inner_stride = plan.inner_stride;
  }
  // Tables only occur with unit <= es (see above), where es / unit is exact.
  p.table_scale = unit <= es ? es / unit : 1;
  p.outer_stride = plan.outer_stride * es / unit;
  p.dim_stride = plan.dim_stride * es / unit;

  const int64_t total = plan.outer * plan.k * inner_units;
  const int64_t* perm_ptr = kept.const_data_ptr<int64_t>();
  const void* s = src.const_data_ptr();
  void* o = out.data_ptr();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (unit) {
    case 1: launch_any_index<uint8_t>(s, o, perm_ptr, total, inner_units, k, p, stream); break;
    case 2: launch_any_index<uint16_t>(s, o, perm_ptr, total, inner_units, k, p, stream); break;
    case 4: launch_any_index<uint32_t>(s, o, perm_ptr, total, inner_units, k, p, stream); break;
    case 8: launch_any_index<uint2>(s, o, perm_ptr, total, inner_units, k, p, stream); break;
    default:
      if (src_addr % 16 == 0) {
        launch_any_index<uint4>(s, o, perm_ptr, total, inner_units, k, p, stream);
      } else {
        launch_any_index<Bytes16>(s, o, perm_ptr, total, inner_units, k, p, stream);
      }
  }
  return out;
}

}  // namespace
}  // namespace elastic_plugin

TORCH_LIBRARY_IMPL(elastic_plugin, CUDA, m) {
  m.impl("ordered_gather", &elastic_plugin::ordered_gather_cuda);
}
