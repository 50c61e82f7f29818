// Export quantization of weights on CPU, in one pass (FP8 E4M3 and NVFP4).
//
// The PyTorch compositions (elastic_plugin/ops/_quantize.py, the references and fallbacks)
// make several passes over the weight (about twenty for NVFP4); these kernels read it once,
// with the same fp32 arithmetic in the same order, so the bytes are identical (tests compare
// them bitwise).
//
//   fp8:    q           = e4m3(clamp(x / s, -448, 448))
//   nvfp4:  block_scale = e4m3(clamp(amax / (6 * g), 2^-9, 448))   (amax 0 -> scale 1)
//           code        = e2m1(x / (float(block_scale) * g))       (round half to even code)
//
// s / g is the scale of the row's tensor (one per expert for a 3-D stack: the caller passes
// it per row).  Non-finite weights are refused: their codes would be meaningless.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>

namespace elastic_plugin {
namespace {

constexpr int64_t kBlock = 16;
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kE4M3MinSubnormal = 1.0f / 512.0f;  // 2^-9

// Round half to even of 0 <= x < 2^22 in the default rounding mode, without a libm call
// (nearbyint is one without SSE4.1): adding 2^23 leaves no fraction bits.
inline float round_half_even(float x) { return (x + 8388608.0f) - 8388608.0f; }

// E2M1 code of q (bit 3: q < 0). The grid step is 0.5 below 2, 1 in [2, 4) and 2 from 4 on;
// rounding half to even on each step's multiples gives the even code. Written without
// branches (selects) so the block loop vectorizes; |q| >= 16 saturates like 16 does.
inline uint8_t e2m1_code(float q) {
  const float abs_q = std::fabs(q);
  const float a = abs_q < 16.0f ? abs_q : 16.0f;
  const float per_step = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float first_code = a < 2.0f ? 0.0f : (a < 4.0f ? 2.0f : 4.0f);
  const float rounded = round_half_even(a * per_step) + first_code;
  const float code = rounded < 7.0f ? rounded : 7.0f;
  return static_cast<uint8_t>(static_cast<int>(code) | (q < 0.0f ? 0x08 : 0x00));
}

// Blocks [begin, end) of rows of `blocks` blocks; returns whether a non-finite value was seen.
template <typename T>
bool quantize_blocks(const T* w, const float* row_scale, uint8_t* packed, c10::Float8_e4m3fn* block_scale,
                     int64_t blocks, int64_t begin, int64_t end) {
  bool bad = false;
  for (int64_t b = begin; b < end; ++b) {
    const float g = row_scale[b / blocks];
    const T* x = w + b * kBlock;
    float v[kBlock];
    float amax = 0.0f;
    // plain compares, not fmax/fmin: those are libm calls (NaN rules) and stop vectorizing;
    // a NaN fails `<= max` and is refused by the caller, so the amax never needs to carry it
    for (int64_t i = 0; i < kBlock; ++i) {
      v[i] = static_cast<float>(x[i]);
      const float a = std::fabs(v[i]);
      bad |= !(a <= std::numeric_limits<float>::max());
      amax = a > amax ? a : amax;
    }
    float s = amax / (kE2M1Max * g);
    if (s == 0.0f) s = 1.0f;
    s = s < kE4M3MinSubnormal ? kE4M3MinSubnormal : (s > kE4M3Max ? kE4M3Max : s);
    const c10::Float8_e4m3fn s8(s);
    block_scale[b] = s8;
    const float denom = static_cast<float>(s8) * g;
    uint8_t code[kBlock];
    for (int64_t i = 0; i < kBlock; ++i) code[i] = e2m1_code(v[i] / denom);
    uint8_t* out = packed + b * (kBlock / 2);
    for (int64_t i = 0; i < kBlock / 2; ++i) out[i] = static_cast<uint8_t>(code[2 * i] | (code[2 * i + 1] << 4));
  }
  return bad;
}

template <typename T>
void quantize_rows(const T* w, const float* row_scale, uint8_t* packed, c10::Float8_e4m3fn* block_scale,
                   int64_t rows, int64_t cols, std::atomic<bool>* non_finite) {
  const int64_t blocks = cols / kBlock;
  at::parallel_for(0, rows * blocks, 4096, [&](int64_t begin, int64_t end) {
    if (quantize_blocks(w, row_scale, packed, block_scale, blocks, begin, end)) non_finite->store(true);
  });
}

// The argument checks both ops share (the Python front checks the same first).
void check_weight_args(const char* op, const at::Tensor& w, const at::Tensor& row_scale, int64_t col_multiple) {
  TORCH_CHECK_VALUE(w.dim() == 2, op, ": w must be 2-D [rows, cols], got ", w.dim(), "-D");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, op,
                   ": w must be float32 or bfloat16, got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.size(1) % col_multiple == 0, op, ": cols must divide by ", col_multiple, ", got ",
                    w.size(1));
  TORCH_CHECK_TYPE(row_scale.scalar_type() == at::kFloat, op, ": row_scale must be float32, got ",
                   row_scale.scalar_type());
  TORCH_CHECK_VALUE(row_scale.dim() == 1 && row_scale.size(0) == w.size(0), op,
                    ": row_scale must be 1-D of size rows=", w.size(0), ", got shape ", row_scale.sizes());
}

void check_finite(const char* op, const std::atomic<bool>& non_finite) {
  TORCH_CHECK_VALUE(!non_finite.load(), op, ": w has NaN or infinite values; their codes would be meaningless");
}

// Rows [begin, end) of `cols` values: q = e4m3(clamp(x / s, -448, 448)); true if a value is non-finite.
template <typename T>
bool fp8_rows(const T* w, const float* row_scale, c10::Float8_e4m3fn* out, int64_t cols, int64_t begin,
              int64_t end) {
  bool bad = false;
  for (int64_t r = begin; r < end; ++r) {
    const float s = row_scale[r];
    const T* x = w + r * cols;
    c10::Float8_e4m3fn* q = out + r * cols;
    for (int64_t i = 0; i < cols; ++i) {
      const float v = static_cast<float>(x[i]);
      bad |= !(std::fabs(v) <= std::numeric_limits<float>::max());
      const float scaled = v / s;
      q[i] = c10::Float8_e4m3fn(scaled < -kE4M3Max ? -kE4M3Max : (scaled > kE4M3Max ? kE4M3Max : scaled));
    }
  }
  return bad;
}

at::Tensor fp8_quantize_cpu(const at::Tensor& w, const at::Tensor& row_scale) {
  check_weight_args("fp8_quantize", w, row_scale, 1);
  const at::Tensor src = w.contiguous();
  const at::Tensor scale = row_scale.contiguous();
  const int64_t rows = src.size(0), cols = src.size(1);
  at::Tensor out = at::empty({rows, cols}, src.options().dtype(at::kFloat8_e4m3fn));
  auto* q = static_cast<c10::Float8_e4m3fn*>(out.data_ptr());
  std::atomic<bool> non_finite{false};
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const bool bad = src.scalar_type() == at::kFloat
        ? fp8_rows(src.const_data_ptr<float>(), scale.const_data_ptr<float>(), q, cols, begin, end)
        : fp8_rows(static_cast<const c10::BFloat16*>(src.const_data_ptr()), scale.const_data_ptr<float>(), q,
                   cols, begin, end);
    if (bad) non_finite.store(true);
  });
  check_finite("fp8_quantize", non_finite);
  return out;
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cpu(const at::Tensor& w, const at::Tensor& row_scale) {
  check_weight_args("nvfp4_quantize", w, row_scale, kBlock);
  const at::Tensor src = w.contiguous();
  const at::Tensor scale = row_scale.contiguous();
  const int64_t rows = src.size(0), cols = src.size(1);
  at::Tensor packed = at::empty({rows, cols / 2}, src.options().dtype(at::kByte));
  at::Tensor block_scale = at::empty({rows, cols / kBlock}, src.options().dtype(at::kFloat8_e4m3fn));
  std::atomic<bool> non_finite{false};
  auto* bs = static_cast<c10::Float8_e4m3fn*>(block_scale.data_ptr());
  if (src.scalar_type() == at::kFloat) {
    quantize_rows(src.const_data_ptr<float>(), scale.const_data_ptr<float>(),
                  packed.data_ptr<uint8_t>(), bs, rows, cols, &non_finite);
  } else {
    quantize_rows(static_cast<const c10::BFloat16*>(src.const_data_ptr()),
                  scale.const_data_ptr<float>(), packed.data_ptr<uint8_t>(), bs, rows, cols, &non_finite);
  }
  check_finite("nvfp4_quantize", non_finite);
  return {packed, block_scale};
}

}  // namespace
}  // namespace elastic_plugin

TORCH_LIBRARY_FRAGMENT(elastic_plugin, m) {
  m.def("fp8_quantize(Tensor w, Tensor row_scale) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("nvfp4_quantize(Tensor w, Tensor row_scale) -> (Tensor, Tensor)", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(elastic_plugin, CPU, m) {
  m.impl("fp8_quantize", &elastic_plugin::fp8_quantize_cpu);
  m.impl("nvfp4_quantize", &elastic_plugin::nvfp4_quantize_cpu);
}
