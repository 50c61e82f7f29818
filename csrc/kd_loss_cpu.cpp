// kd_row_stats / kd_grad: the distillation loss KL(p_teacher || p_student) over logit rows,
// in one read of the logits per pass, with no temporaries the size of the logits.
//
// With s = student / T and t = teacher / T (one row of this rank's vocab shard):
//   kd_row_stats -> [5, rows] float64 (sums accumulated in double: the KL is a difference of
//   log-sums and loses digits to cancellation if they are rounded to float first): m_s = max s, z_s = sum e^(s - m_s), m_t = max t,
//                    z_t = sum e^(t - m_t), a = sum e^(t - m_t) (t - s)
//   (a teacher value of -inf adds nothing to a, not 0 * inf).  Under tensor parallelism the
//   caller combines the shards' rows (max, then rescaled sums); then
//   KL = a / z_t - (m_t + log z_t) + (m_s + log z_s).
//   kd_grad(lse [2, rows] = m + log z of student and teacher, scale [rows]) -> the gradient
//   scale_r * (e^(s - lse_s) - e^(t - lse_t)), in the student's dtype.
//
// Why a kernel: as a composition of torch ops the loss read and wrote [rows, vocab] FP32
// tensors about ten times per step (scale, max, subtract, exp, multiply, mask, sum, each a
// fresh tensor); measured on SmolLM2's 49,152-token vocabulary at 2,048 tokens it took 4.5 s of
// a 32 s elastic step on 2 cores.  Here a row's student and teacher values (2 x 192 KB at that
// vocabulary) are read from memory once per pass and stay in the core's L2 cache for the
// second read.  The exp is an AVX2 polynomial where the CPU has AVX2 and FMA (chosen at run
// time, like cpu_simd.h), else std::exp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ELASTIC_PLUGIN_KD_AVX2 1
#else
#define ELASTIC_PLUGIN_KD_AVX2 0
#endif

namespace elastic_plugin {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load_scalar(const float* p, int64_t i) { return p[i]; }
inline float load_scalar(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

// ---------------------------------------------------------------- portable rows
template <typename T>
void stats_row_scalar(const T* s, const T* t, int64_t n, float temp, double* out) {
  float ms = kNegInf, mt = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    ms = std::max(ms, load_scalar(s, i));
    mt = std::max(mt, load_scalar(t, i));
  }
  ms /= temp, mt /= temp;
  double zs = 0, zt = 0, a = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float sv = load_scalar(s, i) / temp, tv = load_scalar(t, i) / temp;
    zs += std::exp(sv - ms);
    const float et = std::exp(tv - mt);
    zt += et;
    if (et > 0.f) a += et * (tv - sv);
  }
  out[0] = ms, out[1] = zs, out[2] = mt, out[3] = zt, out[4] = a;
}

template <typename T>
void grad_row_scalar(const T* s, const T* t, int64_t n, float temp, float lse_s, float lse_t, float scale,
                     T* g) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * (std::exp(load_scalar(s, i) / temp - lse_s) - std::exp(load_scalar(t, i) / temp - lse_t));
    g[i] = static_cast<T>(v);
  }
}

#if ELASTIC_PLUGIN_KD_AVX2
#define KD_AVX2 __attribute__((target("avx2,fma")))

// e^x for 8 floats: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by its degree-7 Taylor
// polynomial (truncation < 6e-9 relative, under half an ulp), times 2^n; e^x = 0 below
// -87.33 (where float underflows), so -inf gives 0 and never a NaN.
KD_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365447505531f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);     // ln2, the rest
  __m256 y = _mm256_set1_ps(1.f / 5040.f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 720.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

KD_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KD_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

KD_AVX2 inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// Sums of a row are kept in double (4 lanes per accumulator): a 49,152-value row summed in
// float lanes would lose a few ulps against the FP64 truth.
KD_AVX2 inline __m256d widen_lo(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
KD_AVX2 inline __m256d widen_hi(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
KD_AVX2 inline void accumulate(__m256d& acc, __m256 v) {
  acc = _mm256_add_pd(acc, _mm256_add_pd(widen_lo(v), widen_hi(v)));
}
KD_AVX2 inline double hsum4(__m256d v) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, v);
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

template <typename T>
KD_AVX2 void stats_row_avx2(const T* s, const T* t, int64_t n, float temp, double* out) {
  const __m256 vt = _mm256_set1_ps(temp);
  __m256 vms = _mm256_set1_ps(kNegInf), vmt = vms;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    vms = _mm256_max_ps(vms, load8(s + i));
    vmt = _mm256_max_ps(vmt, load8(t + i));
  }
  float ms = hmax8(vms), mt = hmax8(vmt);
  for (; i < n; ++i) {
    ms = std::max(ms, load_scalar(s, i));
    mt = std::max(mt, load_scalar(t, i));
  }
  ms /= temp, mt /= temp;  // T > 0: the max of x / T is (max x) / T
  const __m256 bms = _mm256_set1_ps(ms), bmt = _mm256_set1_ps(mt), zero = _mm256_setzero_ps();
  __m256d zs = _mm256_setzero_pd(), zt = zs, a = zs;
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 sv = _mm256_div_ps(load8(s + i), vt), tv = _mm256_div_ps(load8(t + i), vt);
    accumulate(zs, exp8(_mm256_sub_ps(sv, bms)));
    const __m256 et = exp8(_mm256_sub_ps(tv, bmt));
    accumulate(zt, et);
    const __m256 live = _mm256_cmp_ps(et, zero, _CMP_GT_OQ);  // e^t = 0 adds nothing
    accumulate(a, _mm256_and_ps(live, _mm256_mul_ps(et, _mm256_sub_ps(tv, sv))));
  }
  double dzs = hsum4(zs), dzt = hsum4(zt), da = hsum4(a);
  for (; i < n; ++i) {
    const float sv = load_scalar(s, i) / temp, tv = load_scalar(t, i) / temp;
    dzs += std::exp(sv - ms);
    const float et = std::exp(tv - mt);
    dzt += et;
    if (et > 0.f) da += et * (tv - sv);
  }
  out[0] = ms, out[1] = dzs, out[2] = mt, out[3] = dzt, out[4] = da;
}

KD_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
KD_AVX2 inline void store8(c10::BFloat16* p, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int k = 0; k < 8; ++k) p[k] = c10::BFloat16(lanes[k]);  // round to nearest even
}

template <typename T>
KD_AVX2 void grad_row_avx2(const T* s, const T* t, int64_t n, float temp, float lse_s, float lse_t, float scale,
                           T* g) {
  const __m256 vt = _mm256_set1_ps(temp), bs = _mm256_set1_ps(lse_s), bt = _mm256_set1_ps(lse_t);
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 ps = exp8(_mm256_sub_ps(_mm256_div_ps(load8(s + i), vt), bs));
    const __m256 pt = exp8(_mm256_sub_ps(_mm256_div_ps(load8(t + i), vt), bt));
    store8(g + i, _mm256_mul_ps(sc, _mm256_sub_ps(ps, pt)));
  }
  if (i < n) grad_row_scalar(s + i, t + i, n - i, temp, lse_s, lse_t, scale, g + i);
}

bool use_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#else
bool use_avx2() { return false; }
#endif

// ---------------------------------------------------------------- ops
void check_logits(const char* op, const at::Tensor& student, const at::Tensor& teacher) {
  TORCH_CHECK_VALUE(student.dim() == 2 && teacher.sizes() == student.sizes(), op,
                    ": student and teacher must be 2-D [rows, vocab] of one shape, got ", student.sizes(), " and ",
                    teacher.sizes());
  TORCH_CHECK_TYPE(student.scalar_type() == teacher.scalar_type() &&
                       (student.scalar_type() == at::kFloat || student.scalar_type() == at::kBFloat16),
                   op, ": student and teacher must both be float32 or both bfloat16, got ", student.scalar_type(),
                   " and ", teacher.scalar_type());
}

int64_t grain_rows(int64_t vocab) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(vocab, 1)); }

template <typename T>
void stats_rows(const T* s, const T* t, int64_t rows, int64_t vocab, float temp, double* out) {
  const bool avx2 = use_avx2();
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    double row[5];
    for (int64_t r = begin; r < end; ++r) {
#if ELASTIC_PLUGIN_KD_AVX2
      if (avx2)
        stats_row_avx2(s + r * vocab, t + r * vocab, vocab, temp, row);
      else
#endif
        stats_row_scalar(s + r * vocab, t + r * vocab, vocab, temp, row);
      for (int k = 0; k < 5; ++k) out[k * rows + r] = row[k];
    }
  });
  (void)avx2;
}

template <typename T>
void grad_rows(const T* s, const T* t, int64_t rows, int64_t vocab, float temp, const float* lse,
               const float* scale, T* g) {
  const bool avx2 = use_avx2();
  at::parallel_for(0, rows, grain_rows(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t o = r * vocab;
#if ELASTIC_PLUGIN_KD_AVX2
      if (avx2)
        grad_row_avx2(s + o, t + o, vocab, temp, lse[r], lse[rows + r], scale[r], g + o);
      else
#endif
        grad_row_scalar(s + o, t + o, vocab, temp, lse[r], lse[rows + r], scale[r], g + o);
    }
  });
  (void)avx2;
}

at::Tensor kd_row_stats_cpu(const at::Tensor& student, const at::Tensor& teacher, double temperature) {
  check_logits("kd_row_stats", student, teacher);
  const at::Tensor s = student.contiguous(), t = teacher.contiguous();
  const int64_t rows = s.size(0), vocab = s.size(1);
  at::Tensor out = at::empty({5, rows}, s.options().dtype(at::kDouble));
  const float temp = static_cast<float>(temperature);
  TORCH_CHECK_VALUE(temp > 0.f, "kd: temperature must be > 0, got ", temperature);
  if (s.scalar_type() == at::kFloat) {
    stats_rows(s.const_data_ptr<float>(), t.const_data_ptr<float>(), rows, vocab, temp, out.data_ptr<double>());
  } else {
    stats_rows(static_cast<const c10::BFloat16*>(s.const_data_ptr()),
               static_cast<const c10::BFloat16*>(t.const_data_ptr()), rows, vocab, temp, out.data_ptr<double>());
  }
  return out;
}

at::Tensor kd_grad_cpu(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& lse,
                       const at::Tensor& scale, double temperature) {
  check_logits("kd_grad", student, teacher);
  const int64_t rows = student.size(0), vocab = student.size(1);
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == 2 && lse.size(1) == rows,
                    "kd_grad: lse must be float32 [2, rows=", rows, "], got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == rows,
                    "kd_grad: scale must be float32 [rows=", rows, "], got ", scale.scalar_type(), " ",
                    scale.sizes());
  const at::Tensor s = student.contiguous(), t = teacher.contiguous();
  const at::Tensor l = lse.contiguous(), c = scale.contiguous();
  at::Tensor grad = at::empty({rows, vocab}, s.options());
  const float temp = static_cast<float>(temperature);
  TORCH_CHECK_VALUE(temp > 0.f, "kd: temperature must be > 0, got ", temperature);
  if (s.scalar_type() == at::kFloat) {
    grad_rows(s.const_data_ptr<float>(), t.const_data_ptr<float>(), rows, vocab, temp, l.const_data_ptr<float>(),
              c.const_data_ptr<float>(), grad.data_ptr<float>());
  } else {
    grad_rows(static_cast<const c10::BFloat16*>(s.const_data_ptr()),
              static_cast<const c10::BFloat16*>(t.const_data_ptr()), rows, vocab, temp, l.const_data_ptr<float>(),
              c.const_data_ptr<float>(), static_cast<c10::BFloat16*>(grad.data_ptr()));
  }
  return grad;
}

}  // namespace
}  // namespace elastic_plugin

TORCH_LIBRARY_FRAGMENT(elastic_plugin, m) {
  m.def("kd_row_stats(Tensor student, Tensor teacher, float temperature) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("kd_grad(Tensor student, Tensor teacher, Tensor lse, Tensor scale, float temperature) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(elastic_plugin, CPU, m) {
  m.impl("kd_row_stats", &elastic_plugin::kd_row_stats_cpu);
  m.impl("kd_grad", &elastic_plugin::kd_grad_cpu);
}
