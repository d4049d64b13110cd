// dequant_linear: a linear layer over int8 or float8 weights with a scale per
// output channel (defs/dequant_linear.py). The weight is dequantized into a
// buffer this thread keeps between calls (one pass over the stored weight, no
// fresh allocation: eager's sequence makes one or two full-size copies per
// call), ATen's GEMM multiplies (in float32 for a 16-bit x where the CPU has
// no 16-bit GEMM instructions: kWidenHalfGemm), and one pass over the output
// applies what follows the GEMM (the int8 form's scale, the bias, the output
// cast) in place where the output has the GEMM's type.

#include "quantized.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <array>
#include <cstring>
#include <type_traits>

namespace mindiesd_cpu {
namespace {

// The float32 value of every byte of a one-byte storage type (c10's conversion, once): a table lookup per element
// instead of c10's bit-by-bit float8 decoding, which ATen's own cast runs per element.
template <typename TQ>
const float* byte_values() {
  static_assert(sizeof(TQ) == 1, "one-byte storage types only");
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int i = 0; i < 256; ++i) {
      const uint8_t byte = static_cast<uint8_t>(i);
      TQ v;
      std::memcpy(&v, &byte, 1);
      values[i] = static_cast<float>(v);
    }
    return values;
  }();
  return table.data();
}

// Whether a 16-bit layer runs its GEMM in float32. Where the CPU has no 16-bit dot-product instructions (the AVX2
// and baseline builds), ATen's bfloat16 and float16 GEMMs widen their operands in software and run at a fraction
// of the float32 GEMM's rate; there the layer multiplies the same 16-bit values in float32 (each product exact, the
// sums in float32 as the 16-bit GEMM accumulates) and rounds the result to x's type, as that GEMM does.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kWidenHalfGemm = false;
#else
constexpr bool kWidenHalfGemm = true;
#endif

// w[n, k] = T(float32(q) * scale[n]) (scale_first) or T(q), stored as TW (T, or float32 holding T's values), rows
// split across threads.
template <typename T, typename TQ, typename TS, typename TW>
void dequantize(const TQ* q, const TS* scale, TW* w, int64_t n, int64_t k, bool scale_first) {
  const float* values = byte_values<TQ>();
  at::parallel_for(0, n, row_grain(k), [&](int64_t begin, int64_t end) {
    alignas(64) std::array<float, kBlock> widened;
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = reinterpret_cast<const uint8_t*>(q) + r * k;
      TW* out = w + r * k;
      const fVec s(scale_first ? static_cast<float>(scale[r]) : 1.0f);
      for_each_block(0, k, false, [&](const auto& block) {
        for (int64_t j = 0; j < block.n; ++j) {
          widened[j] = values[in[block.j + j]];
        }
        fVec a = fVec::loadu(widened.data()), b = fVec::loadu(widened.data() + kLanes);
        if (scale_first) {
          a = a * s;
          b = b * s;
        }
        round_through<T>(a, b);
        block.store(out, a, b);
      });
    }
  });
}

// out[m, n] = TO(((y * scale[n]) rounded as TP) + bias[n] (rounded as TSUM)), y the GEMM's output (of x's type T,
// or float32 rounded to T here).
template <typename T, typename TY, typename TS, typename TB, typename TO>
void finish_rows(const TY* y, const TS* scale, const TB* bias, TO* out, int64_t rows, int64_t n, Epilogue rounding) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const TY* in = y + r * n;
      TO* result = out + r * n;
      for_each_block(0, n, false, [&](const auto& block) {
        auto [a, b] = block.load(in);
        if constexpr (std::is_same_v<TY, float>) {
          round_through<T>(a, b);  // the 16-bit GEMM's output, rounded to T
        }
        finish_block<T>(block, a, b, scale, bias, result, rounding);
      });
    }
  });
}

template <typename F>
bool dispatch_storage(ScalarType t, const F& f) {
  switch (t) {
    case ScalarType::Char:
      f(int8_t{});
      return true;
    case ScalarType::Float8_e4m3fn:
      f(c10::Float8_e4m3fn{});
      return true;
    case ScalarType::Float8_e5m2:
      f(c10::Float8_e5m2{});
      return true;
    case ScalarType::Float8_e4m3fnuz:
      f(c10::Float8_e4m3fnuz{});
      return true;
    case ScalarType::Float8_e5m2fnuz:
      f(c10::Float8_e5m2fnuz{});
      return true;
    default:
      return false;
  }
}

}  // namespace

std::optional<Tensor> dequant_linear(const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                                     const std::optional<Tensor>& bias, bool scale_first, ScalarType out_dtype) {
  const bool biased = bias.has_value() && bias->defined();
  const ScalarType t = x.scalar_type();
  if (!dispatch_storage(weight.scalar_type(), [](auto) {}) ||
      !covers_layer(x, weight, weight_scale, bias, out_dtype)) {
    return std::nullopt;
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  const int64_t k = x.size(-1), n = weight.size(0);
  const int64_t rows = x.numel() / k;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  if (rows == 0) {
    return empty_output(x, sizes, out_dtype);
  }
  const Tensor q = weight.is_contiguous() ? weight : weight.contiguous();
  const Tensor s = weight_scale.is_contiguous() ? weight_scale : weight_scale.contiguous();
  // the GEMM's type: x's, or float32 holding x's values (kWidenHalfGemm)
  const ScalarType g = kWidenHalfGemm ? ScalarType::Float : t;
  Tensor w = scratch(n, k, g);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_storage(q.scalar_type(), [&](auto storage_tag) {
      using TQ = decltype(storage_tag);
      auto into = [&](auto* out) {
        if (s.scalar_type() == ScalarType::Float) {
          dequantize<T, TQ>(q.const_data_ptr<TQ>(), s.const_data_ptr<float>(), out, n, k, scale_first);
        } else {
          dequantize<T, TQ>(q.const_data_ptr<TQ>(), s.const_data_ptr<T>(), out, n, k, scale_first);
        }
      };
      if (g == ScalarType::Float) {
        into(w.mutable_data_ptr<float>());
      } else {
        into(w.mutable_data_ptr<T>());
      }
    });
  });
  const Tensor x2d = x.reshape({rows, k});
  Tensor y = empty_output(x, {rows, n}, g);
  at::mm_out(y, g == t ? x2d : x2d.to(g), w.t());
  const bool scaled = !scale_first;
  if (!scaled && !biased && out_dtype == t && g == t) {
    return y.view(sizes);
  }
  // the product rounds to T where the scale is T (else float32), the sum where the product and the bias do
  const bool round_product = scaled && s.scalar_type() == t;
  const bool round_sum = (!scaled || round_product) && (!biased || bias->scalar_type() == t);
  const Tensor b = biased ? (bias->is_contiguous() ? *bias : bias->contiguous()) : Tensor();
  Tensor out = out_dtype == g ? y : empty_output(x, {rows, n}, out_dtype);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_epilogue<T>(s.scalar_type(), biased ? b.scalar_type() : t, out_dtype, [&](auto ts, auto tb, auto to) {
      using TS = decltype(ts);
      using TB = decltype(tb);
      using TO = decltype(to);
      auto finish = [&](const auto* product) {
        finish_rows<T>(product, scaled ? s.const_data_ptr<TS>() : nullptr, biased ? b.const_data_ptr<TB>() : nullptr,
                       out.mutable_data_ptr<TO>(), rows, n, Epilogue{round_product, round_sum});
      };
      if (g == ScalarType::Float) {
        finish(y.const_data_ptr<float>());
      } else {
        finish(y.const_data_ptr<T>());
      }
    });
  });
  return out.view(sizes);
}

namespace {

// The executor's entry (entries.h): dequant_linear(x, weight, weight_scale, bias, scale_first) with the resolved
// out_dtype.
const EntryRegistrar kDequantLinearEntry("dequant_linear", [](const EntryArgs& a) {
  return mindiesd_cpu::dequant_linear(a.tensor(0), a.tensor(1), a.tensor(2), a.optional_tensor(3), a.to_bool(4),
                                      a.out_dtype());
});

}  // namespace

}  // namespace mindiesd_cpu
