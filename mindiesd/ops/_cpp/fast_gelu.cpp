// fast_gelu: tanh-approximated GELU, elementwise (a flat loop over contiguous
// input, a TensorIterator otherwise).

#include "common.h"

#include <ATen/native/TensorIterator.h>
#include <ATen/native/cpu/Loops.h>

#include <cmath>

namespace mindiesd_cpu {
namespace {

constexpr float kGeluCoefficient = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
inline float gelu_tanh(float v) {
  const float u = kGeluCoefficient * (v + kGeluCubic * v * v * v);
  return v / (1.0f + std::exp(-2.0f * u));
}

// 1 / d for d >= 1: hardware estimate refined by one Newton step (about
// 1 ulp), much cheaper than a vector division.
inline fVec reciprocal(const fVec& d) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 estimate = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(estimate, _mm512_fnmadd_ps(d, estimate, _mm512_set1_ps(2.0f)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 estimate = _mm256_rcp_ps(d);
  return _mm256_mul_ps(estimate, _mm256_fnmadd_ps(d, estimate, _mm256_set1_ps(2.0f)));
#else
  return fVec(1.0f) / d;
#endif
}

// exp(t) for t in [-87, 88] (callers clamp), about 2 ulp: t = n ln2 + r with
// |r| <= ln2 / 2, a degree-5 polynomial for exp(r), then a scale by 2^n.
inline fVec exp_clamped(const fVec& t) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  const fVec n = (t * fVec(1.44269504088896341f)).round();
  const fVec r = at::vec::fmadd(n, fVec(-0.693147180559945309f), t);
  fVec poly = at::vec::fmadd(r, fVec(0.00828929059f), fVec(0.0418978221f));
  poly = at::vec::fmadd(poly, r, fVec(0.166676521f));
  poly = at::vec::fmadd(poly, r, fVec(0.499991506f));
  poly = at::vec::fmadd(poly, r, fVec(0.999999701f));
  poly = at::vec::fmadd(poly, r, fVec(1.0f));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_scalef_ps(poly, n);
#else
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return poly * fVec(_mm256_castsi256_ps(exponent));
#endif
#else
  return t.exp_u20();
#endif
}

inline fVec gelu_tanh(const fVec& v) {
  const fVec minus_two_k(-2.0f * kGeluCoefficient);
  const fVec cubic(kGeluCubic);
  const fVec one(1.0f);
  // Clamped so that 1 + exp stays finite (there the result is below 1e-38 |v|)
  // and 2^n stays normal (there it is v itself).
  const fVec inner = at::vec::clamp(at::vec::fmadd(cubic * v, v * v, v) * minus_two_k, fVec(-87.0f), fVec(88.0f));
  return v * reciprocal(one + exp_clamped(inner));
}

template <typename T>
void gelu_loop(at::TensorIteratorBase& iter) {
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpu_kernel_vec(
        iter, [](float v) -> float { return gelu_tanh(v); },
        [](fVec v) -> fVec { return gelu_tanh(v); });
  } else {
    using Vec = at::vec::Vectorized<T>;
    at::native::cpu_kernel_vec(
        iter, [](T v) -> T { return static_cast<T>(gelu_tanh(static_cast<float>(v))); },
        [](Vec v) -> Vec {
          auto [a, b] = at::vec::convert_to_float<T>(v);
          return from_float<T>(gelu_tanh(a), gelu_tanh(b));
        });
  }
}

// Contiguous input: one flat loop over blocks, split across threads.
template <typename T>
void gelu_contiguous(const Tensor& x, Tensor& out) {
  const T* in = x.const_data_ptr<T>();
  T* result = out.mutable_data_ptr<T>();
  const int64_t numel = x.numel();
  const bool stream = streams(out);
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kParallelElements / kBlock, [&](int64_t begin, int64_t end) {
    for_each_block(begin * kBlock, std::min(end * kBlock, numel), stream, [&](const auto& block) {
      const auto [a, b] = block.load(in);
      block.store(result, gelu_tanh(a), gelu_tanh(b));
    });
    finish_streaming(stream);
  });
}

}  // namespace

std::optional<Tensor> fast_gelu(const Tensor& x) {
  if (!on_cpu(x) || !is_covered_float(x.scalar_type())) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  Tensor out = empty_output(x, x.sizes(), x.scalar_type());
  if (x.numel() == 0) {
    return out;
  }
  if (x.is_contiguous()) {
    dispatch_float(x.scalar_type(), [&](auto tag) { gelu_contiguous<decltype(tag)>(x, out); });
    return out;
  }
  auto iter = at::TensorIteratorConfig().add_output(out).add_const_input(x).build();
  dispatch_float(x.scalar_type(), [&](auto tag) { gelu_loop<decltype(tag)>(iter); });
  return out;
}

}  // namespace mindiesd_cpu
