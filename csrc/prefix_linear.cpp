// prefix_linear: y = x[..., :k] @ weight[:n, :k]^T (+ bias[:n]), reading weight in place.
//
// Elastic layers in "sliced mode" run a nested width as a prefix of the full weight:
// column-parallel layers keep the first n output rows (n < N, k = K), row-parallel layers
// the first k input columns (n = N, k < K).  Both prefixes are strided views of the
// row-major [N, K] weight, and BLAS takes a leading dimension, so the GEMM reads the
// prefix where it lies: no copy of the weight, whatever n and k are.  x is viewed the
// same way (a copy of x happens only if its leading dims cannot be flattened).
//
// One device-generic kernel serves CPU and CUDA: at::addmm / at::mm dispatch to MKL /
// oneDNN / cuBLAS, which accept these views as they are.  The fake (meta) rule and
// autograd are registered from Python (elastic_plugin/ops/_masked_gemm.py).
#include <ATen/core/Tensor.h>
#include <ATen/core/enum_tag.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace elastic_plugin {
namespace {

// "torch.int64", as Python spells it (c10 alone prints "Long").
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

// Metadata checks (TypeError / ValueError naming the argument), before any work.
void check_prefix_linear_args(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              int64_t n, int64_t k) {
  TORCH_CHECK_TYPE(x.layout() == at::kStrided && weight.layout() == at::kStrided,
                   "prefix_linear: x and weight must be strided (dense) tensors, got layouts ", x.layout(), " and ",
                   weight.layout());
  TORCH_CHECK_TYPE(is_supported_float(x.scalar_type()),
                   "prefix_linear: x must be float16, bfloat16, float32 or float64, got dtype ",
                   dtype_name(x.scalar_type()));
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "prefix_linear: weight dtype ",
                   dtype_name(weight.scalar_type()), " differs from x dtype ", dtype_name(x.scalar_type()),
                   "; they must match");
  TORCH_CHECK_VALUE(weight.device() == x.device(), "prefix_linear: weight is on ", weight.device(), " but x is on ",
                    x.device(), "; they must be on the same device");
  TORCH_CHECK_VALUE(weight.dim() == 2, "prefix_linear: weight must be 2-D [N, K], got a ", weight.dim(),
                    "-D tensor of shape ", weight.sizes());
  TORCH_CHECK_VALUE(x.dim() >= 1, "prefix_linear: x must have at least 1 dimension, got a 0-d tensor");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_TYPE(bias->layout() == at::kStrided, "prefix_linear: bias must be a strided (dense) tensor");
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "prefix_linear: bias dtype ",
                     dtype_name(bias->scalar_type()), " differs from x dtype ", dtype_name(x.scalar_type()),
                     "; they must match");
    TORCH_CHECK_VALUE(bias->device() == x.device(), "prefix_linear: bias is on ", bias->device(), " but x is on ",
                      x.device(), "; they must be on the same device");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "prefix_linear: bias must be 1-D of size weight.size(0)=", weight.size(0), ", got shape ",
                      bias->sizes());
  }
  TORCH_CHECK_VALUE(n >= 0 && n <= weight.size(0), "prefix_linear: n must be in [0, weight.size(0)=",
                    weight.size(0), "], got ", n);
  TORCH_CHECK_VALUE(k >= 0 && k <= weight.size(1), "prefix_linear: k must be in [0, weight.size(1)=",
                    weight.size(1), "], got ", k);
  TORCH_CHECK_VALUE(k <= x.size(-1), "prefix_linear: k must be <= x.size(-1)=", x.size(-1), ", got ", k);
}

at::Tensor prefix_linear_impl(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              int64_t n, int64_t k) {
  check_prefix_linear_args(x, weight, bias, n, k);
  // [..., k] -> [M, k]: a view whenever the leading dims flatten (always for contiguous x).
  // M is computed, not -1, so that empty inputs (M = 0 or k = 0) reshape too.
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  const at::Tensor x2d = x.narrow(-1, 0, k).reshape({rows, k});
  // weight[:n, :k]^T: shape [k, n], strides (1, K): column-major with leading dimension K.
  const at::Tensor w_t = weight.narrow(0, 0, n).narrow(1, 0, k).t();
  at::Tensor y2d = (bias.has_value() && bias->defined()) ? at::addmm(bias->narrow(0, 0, n), x2d, w_t)
                                                         : at::mm(x2d, w_t);
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  return y2d.view(out_sizes);
}

}  // namespace
}  // namespace elastic_plugin

TORCH_LIBRARY_FRAGMENT(elastic_plugin, m) {
  m.set_python_module("elastic_plugin.ops._masked_gemm");
  m.def("prefix_linear(Tensor x, Tensor weight, Tensor? bias, SymInt n, SymInt k) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

// The same kernel for both devices: ATen picks MKL/oneDNN on CPU and cuBLAS on CUDA.
TORCH_LIBRARY_IMPL(elastic_plugin, CPU, m) {
  m.impl("prefix_linear", &elastic_plugin::prefix_linear_impl);
}

TORCH_LIBRARY_IMPL(elastic_plugin, CUDA, m) {
  m.impl("prefix_linear", &elastic_plugin::prefix_linear_impl);
}
