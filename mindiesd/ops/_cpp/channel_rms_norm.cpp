// channel_rms_norm: x / max(||x||_2 over the channels, eps) * scale * weight[c] + bias[c], then SiLU when asked:
// the norm of Wan's and Qwen-Image's VAEs (F.normalize(x, dim=1) * scale * gamma + bias), eager's six ops (norm,
// clamp, division, two products, sum) and the SiLU in one read for the norms and one read and write for the output.
// Contiguous x ([N, C, S]): each task a block of positions, the sum of squares down the channels in vectors along
// the positions; channels innermost (channels-last): each position a row of C values. The output has x's layout.

#include "common.h"

#include <cmath>

namespace mindiesd_cpu {
namespace {

struct ChannelNorm {
  const float* weight;  // C values, or nullptr
  const float* bias;    // C values, or nullptr
  float scale;
  float eps;
  bool silu;
};

inline fVec finish_value(const fVec& v, const ChannelNorm& p) {
  return p.silu ? silu(v) : v;
}

// Contiguous x: positions in blocks of kBlock; per block the sums of squares over the channels (two vectors),
// then each channel's values scaled by scale / max(norm, eps) * weight[c], plus bias[c].
template <typename TX, typename TO>
void channel_norm_contiguous(const Tensor& x, const ChannelNorm& p, Tensor& out) {
  const int64_t batch = x.size(0);
  const int64_t channels = x.size(1);
  const int64_t spatial = x.numel() / (batch * channels);
  const int64_t blocks = (spatial + kBlock - 1) / kBlock;
  const TX* in = x.const_data_ptr<TX>();
  TO* result = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);
  const int64_t grain = std::max<int64_t>(1, kParallelElements / (channels * kBlock));
  at::parallel_for(0, batch * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks;
      const int64_t first = (task % blocks) * kBlock;
      const TX* sample = in + n * channels * spatial;
      TO* target = result + n * channels * spatial;
      auto body = [&](const auto& block) {
        fVec s0(0.0f), s1(0.0f);
        for (int64_t c = 0; c < channels; ++c) {
          const auto [a, b] = block.load(sample + c * spatial);
          s0 = at::vec::fmadd(a, a, s0);
          s1 = at::vec::fmadd(b, b, s1);
        }
        const fVec eps(p.eps);
        const fVec k0 = fVec(p.scale) / at::vec::maximum(s0.sqrt(), eps);
        const fVec k1 = fVec(p.scale) / at::vec::maximum(s1.sqrt(), eps);
        for (int64_t c = 0; c < channels; ++c) {
          auto [a, b] = block.load(sample + c * spatial);
          const fVec w(p.weight != nullptr ? p.weight[c] : 1.0f);
          const fVec o(p.bias != nullptr ? p.bias[c] : 0.0f);
          a = at::vec::fmadd(a * k0, w, o);
          b = at::vec::fmadd(b * k1, w, o);
          block.store(target + c * spatial, finish_value(a, p), finish_value(b, p));
        }
      };
      if (first + kBlock <= spatial) {
        body(Block<true>{first, kBlock, stream});
      } else {
        body(Block<false>{first, spatial - first, stream});
      }
    }
    finish_streaming(stream);
  });
}

// Channels innermost: each position a row of C values: its sum of squares, then the row scaled, weighted, shifted.
template <typename TX, typename TO>
void channel_norm_rows(const Tensor& x, const ChannelNorm& p, Tensor& out) {
  const int64_t channels = x.size(1);
  const int64_t rows = x.numel() / channels;
  const TX* in = x.const_data_ptr<TX>();
  TO* result = out.mutable_data_ptr<TO>();
  const bool stream = streams(out);
  const int64_t grain = std::max<int64_t>(1, kParallelElements / channels);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const TX* xr = in + row * channels;
      TO* outr = result + row * channels;
      const fVec k(p.scale / std::max(std::sqrt(sum_of_squares(xr, channels)), p.eps));
      for_each_block(0, channels, stream, [&](const auto& block) {
        auto [a, b] = block.load(xr);
        a = a * k;
        b = b * k;
        if (p.weight != nullptr) {
          const auto [wa, wb] = block.load(p.weight);
          a = a * wa;
          b = b * wb;
        }
        if (p.bias != nullptr) {
          const auto [oa, ob] = block.load(p.bias);
          a = a + oa;
          b = b + ob;
        }
        block.store(outr, finish_value(a, p), finish_value(b, p));
      });
    }
    finish_streaming(stream);
  });
}

bool covers_channel_parameter(const std::optional<Tensor>& t, const Tensor& x) {
  if (!t.has_value() || !t->defined()) {
    return true;
  }
  if (!on_cpu(*t) || !is_covered_float(t->scalar_type()) || t->numel() != x.size(1) || t->dim() < 1 ||
      t->size(0) != x.size(1)) {
    return false;
  }
  return t->dim() == 1 || t->dim() == x.dim() - 1;
}

}  // namespace

std::optional<Tensor> channel_rms_norm(const Tensor& x, const std::optional<Tensor>& weight,
                                       const std::optional<Tensor>& bias, double scale, double eps, bool silu) {
  if (!on_cpu(x) || !is_covered_float(x.scalar_type()) || x.dim() < 2 || !covers_channel_parameter(weight, x) ||
      !covers_channel_parameter(bias, x)) {
    return std::nullopt;
  }
  // the promotion of x, weight and bias, as eager's products and sum give
  at::ScalarType out_dtype = x.scalar_type();
  for (const auto* t : {&weight, &bias}) {
    if (t->has_value() && (*t)->defined()) {
      out_dtype = c10::promoteTypes(out_dtype, (*t)->scalar_type());
    }
  }
  if (!is_covered_float(out_dtype)) {
    return std::nullopt;
  }
  return channel_op(x, out_dtype, [&](Tensor& out, bool contiguous) {
    Tensor weight_holder;
    Tensor bias_holder;
    const ChannelNorm p{channel_values(weight, weight_holder), channel_values(bias, bias_holder),
                        static_cast<float>(scale), static_cast<float>(eps), silu};
    dispatch_float(x.scalar_type(), [&](auto x_tag) {
      dispatch_float(out_dtype, [&](auto o_tag) {
        using TX = decltype(x_tag);
        using TO = decltype(o_tag);
        if (contiguous) {
          channel_norm_contiguous<TX, TO>(x, p, out);
        } else {
          channel_norm_rows<TX, TO>(x, p, out);
        }
      });
    });
  });
}

namespace {

// The executor's entry (entries.h): channel_rms_norm(x, weight, bias, scale, eps, silu).
const EntryRegistrar kChannelRmsNormEntry("channel_rms_norm", [](const EntryArgs& a) {
  return mindiesd_cpu::channel_rms_norm(a.tensor(0), a.optional_tensor(1), a.optional_tensor(2), a.to_double(3),
                                        a.to_double(4), a.to_bool(5));
});

}  // namespace

}  // namespace mindiesd_cpu
