// Device-independent part of ordered_gather: checks, strided plan, op schema.
#include "ordered_gather.h"

#include <ATen/core/enum_tag.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace elastic_plugin {

int64_t check_gather_args(const at::Tensor& src, const at::Tensor& perm, int64_t k, int64_t dim) {
  // Type errors first: they say the caller passed the wrong kind of thing.
  TORCH_CHECK_TYPE(src.layout() == at::kStrided,
                   "ordered_gather: src must be a strided (dense) tensor, got layout ", src.layout());
  TORCH_CHECK_TYPE(perm.scalar_type() == at::kLong,
                   "ordered_gather: perm must be an int64 (torch.long) tensor, got dtype ",
                   perm.scalar_type());
  TORCH_CHECK_VALUE(perm.dim() == 1, "ordered_gather: perm must be 1-D, got a ", perm.dim(),
                    "-D tensor of shape ", perm.sizes());
  TORCH_CHECK_VALUE(perm.device() == src.device(), "ordered_gather: perm is on ", perm.device(),
                    " but src is on ", src.device(), "; perm must be on src's device");
  const int64_t ndim = src.dim();
  TORCH_CHECK_VALUE(ndim >= 1, "ordered_gather: src must have at least 1 dimension, got a 0-d tensor");
  TORCH_CHECK_VALUE(dim >= -ndim && dim < ndim, "ordered_gather: dim must be in [", -ndim, ", ",
                    ndim - 1, "] for a ", ndim, "-D src, got ", dim);
  TORCH_CHECK_VALUE(k >= 0 && k <= perm.size(0), "ordered_gather: k must be in [0, len(perm)=",
                    perm.size(0), "], got ", k);
  return dim < 0 ? dim + ndim : dim;
}

void check_perm_range(int64_t min_value, int64_t max_value, int64_t n) {
  TORCH_CHECK_VALUE(min_value >= 0 && max_value < n,
                    "ordered_gather: perm[:k] values must be in [0, src.size(dim)=", n,
                    "), got min ", min_value, " and max ", max_value);
}

namespace {

struct StridedDim {
  int64_t size;
  int64_t stride;
};

// Drops size-1 dims and merges neighbours that step through memory as one dim.
std::vector<StridedDim> collapse_dims(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t begin,
                                      int64_t end) {
  std::vector<StridedDim> dims;
  for (int64_t i = begin; i < end; ++i) {
    if (sizes[i] == 1) continue;
    if (!dims.empty() && dims.back().stride == sizes[i] * strides[i]) {
      dims.back().size *= sizes[i];
      dims.back().stride = strides[i];
    } else {
      dims.push_back({sizes[i], strides[i]});
    }
  }
  return dims;
}

// Element offsets of every index of a multi-dim block (row-major), on `device`.
at::Tensor offset_table(const std::vector<StridedDim>& dims, const at::Device& device) {
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor offsets = at::zeros({1}, opts);
  for (const auto& d : dims) {
    offsets = offsets.unsqueeze(1).add(at::arange(d.size, opts).mul_(d.stride)).reshape({-1});
  }
  return offsets.contiguous();
}

}  // namespace

GatherPlan make_gather_plan(const at::Tensor& src, int64_t dim, int64_t k) {
  GatherPlan plan;
  const auto sizes = src.sizes();
  const auto strides = src.strides();
  plan.n = sizes[dim];
  plan.k = k;
  plan.dim_stride = strides[dim];
  for (int64_t i = 0; i < dim; ++i) plan.outer *= sizes[i];
  for (int64_t i = dim + 1; i < src.dim(); ++i) plan.inner *= sizes[i];
  if (plan.out_numel() == 0) return plan;  // nothing to copy; strides are irrelevant

  const auto outer_dims = collapse_dims(sizes, strides, 0, dim);
  if (outer_dims.size() == 1) {
    plan.outer_stride = outer_dims[0].stride;
  } else if (outer_dims.size() > 1) {
    plan.outer_table = offset_table(outer_dims, src.device());
  }
  const auto inner_dims = collapse_dims(sizes, strides, dim + 1, src.dim());
  if (inner_dims.size() == 1) {
    plan.inner_stride = inner_dims[0].stride;
  } else if (inner_dims.size() > 1) {
    plan.inner_table = offset_table(inner_dims, src.device());
  }
  return plan;
}

at::Tensor empty_gather_output(const at::Tensor& src, int64_t dim, int64_t k) {
  auto out_sizes = src.sizes().vec();
  out_sizes[dim] = k;
  return at::empty(out_sizes, src.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor resolve_lazy_bits(const at::Tensor& src) {
  return (src.is_conj() || src.is_neg()) ? src.resolve_conj().resolve_neg() : src;
}

}  // namespace elastic_plugin

// The op schema.  Kernels: gather_cpu.cpp (CPU), gather_cuda.cu (CUDA).  The fake
// (meta) rule and autograd are registered from Python (elastic_plugin/ops/_gather.py),
// which torch imports on demand thanks to set_python_module.
TORCH_LIBRARY(elastic_plugin, m) {
  m.set_python_module("elastic_plugin.ops._gather");
  m.def("ordered_gather(Tensor src, Tensor perm, SymInt k, int dim) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}
