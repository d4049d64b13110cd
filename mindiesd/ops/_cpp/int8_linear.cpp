// int8_linear: torchao's dynamic per-row int8 quantization of x, the exact
// integer product with the int8 weight and its rescale, with the roundings of
// torchao's unfused sequence (defs/int8_linear.py). One task per block of rows
// quantizes them (the row's minimum and maximum, then its quantized values,
// while the row is in cache); one task per block of output rows rescales the
// int32 product.
//
// The integer product is the same whichever way it is computed, so each CPU
// gets its fastest (IntegerGemm): ATen's _int_mm where oneDNN has int8
// instructions (AMX tiles: int8 x int8; VNNI: uint8 x int8, the activation
// shifted by 128 and the weight's column sums times 128 subtracted), and
// elsewhere, where _int_mm is a scalar loop, float32 GEMMs over blocks of at
// most 1024 columns, whose sums of int8 products are integers below 2^24 and
// so exact, or a direct integer dot product for a few rows.
//
// Every step rounds where eager rounds: the scale in x's type, the products
// and the sum in their promoted types (16-bit types round through their
// vectors, float32 stays). The build uses -std=c++17, so no multiply-add is
// contracted into an FMA (which would round once where eager rounds twice).

#include "quantized.h"

#include <ATen/Context.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

namespace mindiesd_cpu {
namespace {

constexpr float kHalfRange = 127.5f;
constexpr float kQMin = -128.0f;
constexpr float kQMax = 127.0f;

// A float32 value stored in T and read back (float: itself), as a tensor of T holds it.
template <typename T>
inline float stored(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(static_cast<T>(v));
  }
}

inline float nan_min(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::minimum(a, b); }, v);
}

inline float nan_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, v);
}

// The float32 scale of one row of T: clamp(max(-min(amin, 0), max(amax, 0)) / 127.5, eps), rounded to T at
// each step as eager's ops of T round; NaN when the row holds a NaN.
template <typename T>
float row_scale(const T* row, int64_t width, float eps) {
  fVec low(0.0f), high(0.0f);  // minimum(amin, 0) and maximum(amax, 0); the partial block reads zeros
  for_each_block(0, width, false, [&](const auto& block) {
    const auto [a, b] = block.load(row);
    low = at::vec::minimum(low, at::vec::minimum(a, b));
    high = at::vec::maximum(high, at::vec::maximum(a, b));
  });
  const float lo = nan_min(low), hi = nan_max(high);
  if (std::isnan(lo) || std::isnan(hi)) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float amax_abs = std::max(-lo, hi);  // exact in T: a value of T and its negation
  const float scale = stored<T>(amax_abs / kHalfRange);
  const float floor = stored<T>(eps);
  return scale < floor ? floor : scale;
}

// Quantizes ``rows`` rows of x (contiguous [rows, width]) into ``q`` and their scales into ``scales``. Q is what
// the product reads: int8, uint8 (the int8 value plus 128) or float (the int8 value, exact).
template <typename T, typename Q>
void quantize_rows(const T* x, int64_t rows, int64_t width, float eps, Q* q, float* scales) {
  constexpr int32_t offset = std::is_same_v<Q, uint8_t> ? 128 : 0;
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    alignas(64) std::array<float, kBlock> values;
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * width;
      Q* out = q + r * width;
      const float scale = row_scale(row, width, eps);
      scales[r] = scale;
      const fVec inverse(1.0f / scale), lo(kQMin), hi(kQMax);
      for_each_block(0, width, false, [&](const auto& block) {
        auto [a, b] = block.load(row);
        // clamp(round(x * (1 / scale)), -128, 127); a NaN row gives any int8 here and a NaN output row later
        a = at::vec::clamp((a * inverse).round(), lo, hi);
        b = at::vec::clamp((b * inverse).round(), lo, hi);
        a.store(values.data());
        b.store(values.data() + kLanes);
        for (int64_t k = 0; k < block.n; ++k) {
          out[block.j + k] = static_cast<Q>(static_cast<int32_t>(values[k]) + offset);
        }
      });
    }
  });
}

// The product's rows are read through memcpy (a may-alias read) before the block is written, so ``out`` may be
// the product's own memory (a float32 output overwrites the int32 product in place).
//
// What step 5 rounds to: x's type T after the row scale (always), and T or float32 after the weight scale and
// after the bias (the promoted types), before the output's type TO.
template <typename T, typename TS, typename TB, typename TO>
void rescale_rows(const int32_t* acc, const float* scales, const TS* weight_scale, const TB* bias, TO* out,
                  int64_t rows, int64_t n, Epilogue rounding) {
  const bool stream = false;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    alignas(64) std::array<int32_t, kBlock> products;
    alignas(64) std::array<float, kBlock> values;
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* in = acc + r * n;
      TO* result = out + r * n;
      const fVec scale(scales[r]);
      for_each_block(0, n, stream, [&](const auto& block) {
        std::memcpy(products.data(), in + block.j, sizeof(int32_t) * block.n);
        for (int64_t k = 0; k < block.n; ++k) {
          values[k] = static_cast<float>(products[k]);
        }
        fVec a = fVec::loadu(values.data()) * scale;
        fVec b = fVec::loadu(values.data() + kLanes) * scale;
        round_through<T>(a, b);
        finish_block<T>(block, a, b, weight_scale, bias, result, rounding);
      });
    }
  });
}

// Columns of one float32 GEMM block: a sum of at most 1024 products of int8 values (|q w| <= 2^14) stays within
// 2^24, where every float32 partial sum is an exact integer in any order of summation.
constexpr int64_t kExactColumns = 1024;
// Up to this many rows, the product is a direct integer dot product (no float copy of the weight).
constexpr int64_t kDotRows = 4;

std::atomic<int> gemm_choice{static_cast<int>(IntegerGemm::kAuto)};

// Whether ATen's _int_mm takes a uint8 left operand (torch 2.12 on, where torchao takes its uint8 form too): asked
// once, of _int_mm itself.
bool int_mm_takes_uint8() {
  static const bool takes = [] {
    try {
      at::_int_mm(at::zeros({8, 8}, at::TensorOptions().dtype(ScalarType::Byte)),
                  at::zeros({8, 8}, at::TensorOptions().dtype(ScalarType::Char)));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return takes;
}

// The product's form for this CPU and call: oneDNN's int8 GEMM where it has int8 instructions, else float32.
IntegerGemm resolve(IntegerGemm chosen, bool compensated, int64_t rows) {
  if (chosen == IntegerGemm::kAuto) {
    static const bool amx = at::cpu::init_amx();  // whether the CPU and the OS let AMX tiles run
    if (amx) {
      chosen = IntegerGemm::kSigned;
    } else if (at::cpu::is_avx512_vnni_supported()) {
      chosen = compensated ? IntegerGemm::kUnsigned : IntegerGemm::kSigned;
    } else {
      chosen = rows <= kDotRows ? IntegerGemm::kDot : IntegerGemm::kFloat;
    }
  }
  // float32 GEMMs are exact only at float32's own precision (no TF32 or bf16 reduction allowed for matmuls)
  if (chosen == IntegerGemm::kFloat &&
      (at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST ||
       at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) ==
           at::Float32Precision::BF16 ||
       at::globalContext().float32Precision(at::Float32Backend::MKLDNN, at::Float32Op::MATMUL) ==
           at::Float32Precision::TF32)) {
    chosen = IntegerGemm::kSigned;
  }
  if (chosen == IntegerGemm::kUnsigned && !int_mm_takes_uint8()) {
    chosen = IntegerGemm::kSigned;
  }
  return chosen;
}

// acc[m, n] = sum_k q[m, k] * w[n, k] in int32, one task per block of weight rows.
void integer_dot(const int8_t* q, const int8_t* w, int32_t* acc, int64_t rows, int64_t n, int64_t k) {
  at::parallel_for(0, n, row_grain(k * rows), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = w + j * k;
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* qr = q + r * k;
        int32_t sum = 0;
        for (int64_t i = 0; i < k; ++i) {
          sum += static_cast<int32_t>(qr[i]) * static_cast<int32_t>(wj[i]);
        }
        acc[r * n + j] = sum;
      }
    }
  });
}

// The weight as float32, in the thread's kept buffer (quantized.h's scratch).
Tensor float_weight(const Tensor& weight) {
  const int64_t n = weight.size(0), k = weight.size(1);
  Tensor w = scratch(n, k, ScalarType::Float);
  const int8_t* in = weight.const_data_ptr<int8_t>();
  float* out = w.mutable_data_ptr<float>();
  at::parallel_for(0, n * k, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out[i] = static_cast<float>(in[i]);
    }
  });
  return w;
}

// The exact int32 product of float32 rows ``qf`` [M, K] (int8 values) and the int8 weight [N, K]: float32 GEMMs
// over blocks of kExactColumns columns, each rounded to int32 and summed.
Tensor float_product(const Tensor& qf, const Tensor& weight) {
  const Tensor wf = float_weight(weight);
  const int64_t k = qf.size(1);
  Tensor acc;
  Tensor block;
  for (int64_t start = 0; start < k; start += kExactColumns) {
    const int64_t stop = std::min(k, start + kExactColumns);
    block = at::mm(qf.slice(1, start, stop), wf.slice(1, start, stop).t());
    const float* in = block.const_data_ptr<float>();
    if (!acc.defined()) {  // the first block's int32 values take its memory
      acc = block.view(ScalarType::Int);
      int32_t* out = acc.mutable_data_ptr<int32_t>();
      at::parallel_for(0, acc.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          float v;
          std::memcpy(&v, in + i, sizeof(float));
          out[i] = static_cast<int32_t>(v);
        }
      });
    } else {
      int32_t* out = acc.mutable_data_ptr<int32_t>();
      at::parallel_for(0, acc.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          out[i] += static_cast<int32_t>(in[i]);
        }
      });
    }
  }
  return acc;
}

// 128 times the weight's column sums (what the uint8 activation's shift adds to each output), as int32 [N].
Tensor column_sums_128(const Tensor& weight) {
  return weight.sum(1, /*keepdim=*/false, ScalarType::Int).mul_(128);
}

// acc[m, n] -= compensation[n]: the uint8 product made signed.
void subtract_compensation(Tensor& acc, const Tensor& compensation) {
  const int64_t rows = acc.size(0), n = acc.size(1);
  int32_t* out = acc.mutable_data_ptr<int32_t>();
  const int32_t* comp = compensation.const_data_ptr<int32_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t j = 0; j < n; ++j) {
        out[r * n + j] -= comp[j];
      }
    }
  });
}

}  // namespace

void set_int8_gemm(const std::string& name) {
  const std::pair<const char*, IntegerGemm> names[] = {
      {"auto", IntegerGemm::kAuto}, {"signed", IntegerGemm::kSigned}, {"unsigned", IntegerGemm::kUnsigned},
      {"float", IntegerGemm::kFloat}, {"dot", IntegerGemm::kDot}};
  for (const auto& [known, value] : names) {
    if (name == known) {
      gemm_choice = static_cast<int>(value);
      return;
    }
  }
  TORCH_CHECK(false, "int8 GEMM must be auto, signed, unsigned, float or dot, got ", name);
}

std::string int8_gemm(int64_t rows, bool compensated) {
  switch (resolve(static_cast<IntegerGemm>(gemm_choice.load()), compensated, rows)) {
    case IntegerGemm::kSigned:
      return "signed";
    case IntegerGemm::kUnsigned:
      return "unsigned";
    case IntegerGemm::kFloat:
      return "float";
    case IntegerGemm::kDot:
      return "dot";
    default:
      return "auto";
  }
}

std::optional<Tensor> int8_linear(const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                                  const std::optional<Tensor>& bias, const std::optional<Tensor>& compensation,
                                  double eps, ScalarType out_dtype) {
  const bool biased = bias.has_value() && bias->defined();
  const bool compensated = compensation.has_value() && compensation->defined();
  const ScalarType t = x.scalar_type();
  if (!(eps > 0) || weight.scalar_type() != ScalarType::Char ||
      !covers_layer(x, weight, weight_scale, bias, out_dtype) ||
      (compensated && (!on_cpu(*compensation) || compensation->scalar_type() != ScalarType::Int ||
                       compensation->numel() != weight.size(0)))) {
    return std::nullopt;  // K == 0 included: the composition's _int_mm says what it makes of it
  }
  at::NoGradGuard no_grad;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal views skip autograd and view tracking
  const int64_t width = x.size(-1), n = weight.size(0);
  const int64_t rows = x.numel() / width;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  if (rows == 0) {
    return empty_output(x, sizes, out_dtype);
  }
  const Tensor xc = x.is_contiguous() ? x : x.contiguous();
  Tensor scales = empty_output(x, {rows}, ScalarType::Float);
  const Tensor ws = weight_scale.is_contiguous() ? weight_scale : weight_scale.contiguous();
  const Tensor b = biased ? (bias->is_contiguous() ? *bias : bias->contiguous()) : Tensor();
  // the product rounds to T where weight_scale is T (else float32), the sum where both it and the bias are
  const bool round_product = ws.scalar_type() == t;
  const bool round_sum = round_product && (!biased || b.scalar_type() == t);
  const IntegerGemm gemm = resolve(static_cast<IntegerGemm>(gemm_choice.load()), compensated, rows);
  const ScalarType stored = gemm == IntegerGemm::kUnsigned ? ScalarType::Byte
                            : gemm == IntegerGemm::kFloat  ? ScalarType::Float
                                                           : ScalarType::Char;
  Tensor q = empty_output(x, {rows, width}, stored);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    const T* in = xc.const_data_ptr<T>();
    float* row_scales = scales.mutable_data_ptr<float>();
    if (stored == ScalarType::Byte) {
      quantize_rows<T>(in, rows, width, static_cast<float>(eps), q.mutable_data_ptr<uint8_t>(), row_scales);
    } else if (stored == ScalarType::Float) {
      quantize_rows<T>(in, rows, width, static_cast<float>(eps), q.mutable_data_ptr<float>(), row_scales);
    } else {
      quantize_rows<T>(in, rows, width, static_cast<float>(eps), q.mutable_data_ptr<int8_t>(), row_scales);
    }
  });
  const Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  Tensor acc;
  if (gemm == IntegerGemm::kFloat) {
    acc = float_product(q, w);
  } else if (gemm == IntegerGemm::kDot) {
    acc = empty_output(x, {rows, n}, ScalarType::Int);
    integer_dot(q.const_data_ptr<int8_t>(), w.const_data_ptr<int8_t>(), acc.mutable_data_ptr<int32_t>(), rows, n,
                width);
  } else {
    acc = at::_int_mm(q, weight.t());
    if (!acc.is_contiguous()) {
      acc = acc.contiguous();
    }
    if (gemm == IntegerGemm::kUnsigned) {
      const Tensor comp = compensated ? compensation->contiguous() : column_sums_128(w);
      subtract_compensation(acc, comp);
    }
  }
  const Tensor& accc = acc;
  // a float32 output takes the product's memory (same element size, rows rescaled in place): no fresh buffer
  Tensor out = out_dtype == ScalarType::Float ? acc.view(ScalarType::Float).view(sizes)
                                              : empty_output(x, sizes, out_dtype);
  dispatch_float(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_epilogue<T>(ws.scalar_type(), biased ? b.scalar_type() : t, out_dtype, [&](auto ts, auto tb, auto to) {
      using TS = decltype(ts);
      using TB = decltype(tb);
      using TO = decltype(to);
      rescale_rows<T, TS, TB, TO>(accc.const_data_ptr<int32_t>(), scales.const_data_ptr<float>(),
                                  ws.const_data_ptr<TS>(), biased ? b.const_data_ptr<TB>() : nullptr,
                                  out.mutable_data_ptr<TO>(), rows, n, Epilogue{round_product, round_sum});
    });
  });
  return out;
}

namespace {

// The executor's entry (entries.h): int8_linear(x, weight, weight_scale, bias, compensation, eps) with the
// resolved out_dtype.
const EntryRegistrar kInt8LinearEntry("int8_linear", [](const EntryArgs& a) {
  return mindiesd_cpu::int8_linear(a.tensor(0), a.tensor(1), a.tensor(2), a.optional_tensor(3), a.optional_tensor(4),
                                   a.to_double(5), a.out_dtype());
});

}  // namespace

}  // namespace mindiesd_cpu
