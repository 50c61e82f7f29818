// CPU kernel of ordered_gather: OpenMP-parallel (through at::parallel_for, which is
// OpenMP in PyTorch's builds and honours torch.set_num_threads) copy of kept rows.
//
// The row copy itself (shared with ordered_gather_many) is in gather_rows_cpu.h: raw
// units of the element size, so every dtype torch can copy works without a dtype switch.
#include "gather_rows_cpu.h"
#include "ordered_gather.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace elastic_plugin {
namespace {

using cpu::Bytes16;

// Work per parallel task: large enough that thread start-up is amortized.
constexpr int64_t kGrainBytes = 64 * 1024;

// Copies the kept rows of src into out.  T is an unsigned type of the element size.
template <typename T>
void gather_rows(const GatherPlan& p, const T* src, T* out, const int64_t* perm) {
  const int64_t row_bytes = p.inner * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(row_bytes, 1));

  // Last-dim gathers of dense rows may use hardware gathers with int32 indices.
  simd::GatherSegmentFn simd_fn = nullptr;
  std::vector<int32_t> idx32;
  if (p.inner == 1 && p.dim_stride == 1 && p.n <= std::numeric_limits<int32_t>::max()) {
    simd_fn = simd::pick_gather_segment(sizeof(T));
    if (simd_fn != nullptr) idx32.assign(perm, perm + p.k);
  }
  const int32_t* idx_ptr = idx32.empty() ? nullptr : idx32.data();
  at::parallel_for(0, p.outer * p.k, grain, [&](int64_t begin, int64_t end) {
    cpu::copy_kept_rows<T>(p, src, out, perm, idx_ptr, simd_fn, begin, end);
  });
}

template <typename T>
void gather_typed(const GatherPlan& plan, const at::Tensor& src, at::Tensor& out, const int64_t* perm) {
  gather_rows<T>(plan, static_cast<const T*>(src.const_data_ptr()), static_cast<T*>(out.data_ptr()), perm);
}

at::Tensor ordered_gather_cpu(const at::Tensor& src_in, const at::Tensor& perm, int64_t k, int64_t dim) {
  const int64_t d = check_gather_args(src_in, perm, k, dim);
  const at::Tensor src = resolve_lazy_bits(src_in);
  const at::Tensor kept = perm.narrow(0, 0, k).contiguous();
  const int64_t* kept_ptr = kept.const_data_ptr<int64_t>();

  // Cheap value check (k int64 reads, against a copy of outer * k * inner elements).
  if (k > 0) {
    const auto [lo, hi] = std::minmax_element(kept_ptr, kept_ptr + k);
    check_perm_range(*lo, *hi, src.size(d));
  }

  at::Tensor out = empty_gather_output(src, d, k);
  const GatherPlan plan = make_gather_plan(src, d, k);
  if (plan.out_numel() == 0) return out;

  switch (src.element_size()) {
    case 1: gather_typed<uint8_t>(plan, src, out, kept_ptr); break;
    case 2: gather_typed<uint16_t>(plan, src, out, kept_ptr); break;
    case 4: gather_typed<uint32_t>(plan, src, out, kept_ptr); break;
    case 8: gather_typed<uint64_t>(plan, src, out, kept_ptr); break;
    case 16: gather_typed<Bytes16>(plan, src, out, kept_ptr); break;
    default:
      TORCH_CHECK_TYPE(false, "ordered_gather: unsupported element size ", src.element_size(),
                       " bytes (dtype ", src.scalar_type(), ")");
  }
  return out;
}

}  // namespace
}  // namespace elastic_plugin

TORCH_LIBRARY_IMPL(elastic_plugin, CPU, m) {
  m.impl("ordered_gather", &elastic_plugin::ordered_gather_cpu);
}
