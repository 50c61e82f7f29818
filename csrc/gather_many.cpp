// ordered_gather_many: ordered_gather of several tensors with one permutation prefix.
//
//   ordered_gather_many(tensors, perm, k, dims)[i] == ordered_gather(tensors[i], perm, k, dims[i])
//
// Reordering a layer applies one ranking to several tensors (e.g. an FFN's fc1 rows,
// fc1 bias and fc2 columns).  One call checks perm once and, on CPU, copies every
// tensor's kept rows in one parallel region: the work is cut into ~64 KiB tasks over
// (tensor, output rows), so a small tensor (a bias) costs no thread start-up of its own
// and the threads stay busy across tensor boundaries.
//
// CUDA: a loop over the single-tensor op (one launch and one small perm range check per
// tensor; the check is skipped while a CUDA graph is captured).  Reordering is a one-off
// (import, extraction), not a per-step cost, so a fused launch is not worth its
// complexity yet.  The CUDA entry is registered from this C++ file, so it also serves
// builds whose ordered_gather CUDA kernel is the PyTorch fallback.
#include "gather_rows_cpu.h"
#include "ordered_gather.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace elastic_plugin {
namespace {

// Bytes per parallel task: large enough to amortize scheduling, small enough to balance.
constexpr int64_t kTaskBytes = 64 * 1024;
using cpu::Bytes16;

// One tensor of the batch, ready to copy.
struct Job;
using CopyRowsFn = void (*)(const Job& job, const int64_t* perm, const int32_t* idx32, int64_t begin, int64_t end);

struct Job {
  GatherPlan plan;
  at::Tensor src;  // lazy bits resolved; keeps any resolved copy alive
  at::Tensor out;
  CopyRowsFn copy_rows = nullptr;
  simd::GatherSegmentFn simd_fn = nullptr;  // last-dim hardware gather, if usable
};

// Output rows [begin, end) of job `job`, where row r = (outer o, kept position j) = o * k + j.
struct Task {
  int64_t job;
  int64_t begin;
  int64_t end;
};

std::vector<int64_t> check_many_args(at::TensorList tensors, const at::Tensor& perm, int64_t k, at::IntArrayRef dims) {
  TORCH_CHECK_TYPE(perm.scalar_type() == at::kLong,
                   "ordered_gather_many: perm must be an int64 (torch.long) tensor, got dtype ", perm.scalar_type());
  TORCH_CHECK_VALUE(perm.dim() == 1, "ordered_gather_many: perm must be 1-D, got a ", perm.dim(),
                    "-D tensor of shape ", perm.sizes());
  TORCH_CHECK_VALUE(dims.size() == tensors.size(), "ordered_gather_many: dims must have one entry per tensor (",
                    tensors.size(), " tensors), got ", dims.size(), " dims");
  TORCH_CHECK_VALUE(k >= 0 && k <= perm.size(0), "ordered_gather_many: k must be in [0, len(perm)=",
                    perm.size(0), "], got ", k);
  std::vector<int64_t> normalized(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.layout() == at::kStrided, "ordered_gather_many: tensors[", i,
                     "] must be a strided (dense) tensor, got layout ", t.layout());
    TORCH_CHECK_VALUE(t.device() == perm.device(), "ordered_gather_many: tensors[", i, "] is on ", t.device(),
                      " but perm is on ", perm.device(), "; every tensor must be on perm's device");
    const int64_t ndim = t.dim();
    TORCH_CHECK_VALUE(ndim >= 1, "ordered_gather_many: tensors[", i,
                      "] must have at least 1 dimension, got a 0-d tensor");
    const int64_t d = dims[i];
    TORCH_CHECK_VALUE(d >= -ndim && d < ndim, "ordered_gather_many: dims[", i, "] must be in [", -ndim, ", ",
                      ndim - 1, "] for the ", ndim, "-D tensors[", i, "], got ", d);
    normalized[i] = d < 0 ? d + ndim : d;
  }
  return normalized;
}

// Copies output rows [begin, end) of one job.  T is an unsigned type of the element size.
template <typename T>
void copy_rows(const Job& job, const int64_t* perm, const int32_t* idx32, int64_t begin, int64_t end) {
  cpu::copy_kept_rows<T>(job.plan, static_cast<const T*>(job.src.const_data_ptr()),
                         static_cast<T*>(job.out.data_ptr()), perm, idx32, job.simd_fn, begin, end);
}

CopyRowsFn pick_copy_rows(const at::Tensor& src) {
  switch (src.element_size()) {
    case 1: return &copy_rows<uint8_t>;
    case 2: return &copy_rows<uint16_t>;
    case 4: return &copy_rows<uint32_t>;
    case 8: return &copy_rows<uint64_t>;
    case 16: return &copy_rows<Bytes16>;
    default:
      TORCH_CHECK_TYPE(false, "ordered_gather_many: unsupported element size ", src.element_size(),
                       " bytes (dtype ", src.scalar_type(), ")");
  }
}

std::vector<at::Tensor> ordered_gather_many_cpu(at::TensorList tensors, const at::Tensor& perm, int64_t k,
                                                at::IntArrayRef dims) {
  const std::vector<int64_t> d = check_many_args(tensors, perm, k, dims);
  const at::Tensor kept = perm.narrow(0, 0, k).contiguous();
  const int64_t* kept_ptr = kept.const_data_ptr<int64_t>();
  if (k > 0) {
    // One min/max for all tensors; each is then checked against its own size.
    const auto [lo, hi] = std::minmax_element(kept_ptr, kept_ptr + k);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const int64_t n = tensors[i].size(d[i]);
      TORCH_CHECK_VALUE(*lo >= 0 && *hi < n, "ordered_gather_many: perm[:k] values must be in [0, tensors[", i,
                        "].size(dims[", i, "])=", n, "), got min ", *lo, " and max ", *hi);
    }
  }

  std::vector<Job> jobs;
  std::vector<at::Tensor> outputs;
  jobs.reserve(tensors.size());
  outputs.reserve(tensors.size());
  bool any_simd = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    Job job;
    job.src = resolve_lazy_bits(tensors[i]);
    job.out = empty_gather_output(job.src, d[i], k);
    job.plan = make_gather_plan(job.src, d[i], k);
    job.copy_rows = pick_copy_rows(job.src);
    const GatherPlan& p = job.plan;
    if (p.inner == 1 && p.dim_stride == 1 && p.n <= std::numeric_limits<int32_t>::max()) {
      job.simd_fn = simd::pick_gather_segment(job.src.element_size());
      any_simd = any_simd || job.simd_fn != nullptr;
    }
    outputs.push_back(job.out);
    jobs.push_back(std::move(job));
  }
  std::vector<int32_t> idx32;
  if (any_simd) idx32.assign(kept_ptr, kept_ptr + k);  // values checked to be < n <= INT32_MAX

  std::vector<Task> tasks;
  int64_t total_bytes = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const GatherPlan& p = jobs[i].plan;
    if (p.out_numel() == 0) continue;
    const int64_t rows = p.outer * p.k;
    const int64_t row_bytes = p.inner * jobs[i].src.element_size();
    const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(row_bytes, 1));
    for (int64_t b = 0; b < rows; b += grain) {
      tasks.push_back({static_cast<int64_t>(i), b, std::min(rows, b + grain)});
    }
    total_bytes += rows * row_bytes;
  }
  if (tasks.empty()) return outputs;

  const int32_t* idx_ptr = idx32.empty() ? nullptr : idx32.data();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // Below two tasks' worth of bytes, threads would cost more than they save.
  const int64_t task_grain = total_bytes < 2 * kTaskBytes ? num_tasks : 1;
  at::parallel_for(0, num_tasks, task_grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Task& task = tasks[t];
      const Job& job = jobs[task.job];
      job.copy_rows(job, kept_ptr, idx_ptr, task.begin, task.end);
    }
  });
  return outputs;
}

// Any device: the single-tensor op once per tensor, through the dispatcher.
std::vector<at::Tensor> ordered_gather_many_loop(at::TensorList tensors, const at::Tensor& perm, int64_t k,
                                                 at::IntArrayRef dims) {
  const std::vector<int64_t> d = check_many_args(tensors, perm, k, dims);
  static const auto gather = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("elastic_plugin::ordered_gather", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, int64_t)>();
  std::vector<at::Tensor> outputs;
  outputs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    outputs.push_back(gather.call(tensors[i], perm, c10::SymInt(k), d[i]));
  }
  return outputs;
}

}  // namespace
}  // namespace elastic_plugin

// Schema; the fake rule and autograd are registered from Python
// (elastic_plugin/ops/_batched_gather.py).
TORCH_LIBRARY_FRAGMENT(elastic_plugin, m) {
  m.set_python_module("elastic_plugin.ops._batched_gather");
  m.def("ordered_gather_many(Tensor[] tensors, Tensor perm, SymInt k, int[] dims) -> Tensor[]",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(elastic_plugin, CPU, m) {
  m.impl("ordered_gather_many", &elastic_plugin::ordered_gather_many_cpu);
}

TORCH_LIBRARY_IMPL(elastic_plugin, CUDA, m) {
  m.impl("ordered_gather_many", &elastic_plugin::ordered_gather_many_loop);
}
