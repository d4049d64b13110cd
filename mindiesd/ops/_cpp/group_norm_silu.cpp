// group_norm_silu: group normalization of a [N, C, *] x (each group of C / groups channels normalised over its
// channels and spatial positions, biased variance), the per-channel affine and SiLU, in one read of x for the
// statistics and one read and write for the output (eager: a group norm, then a SiLU over its output). Two layouts:
// contiguous (NCHW, NCDHW: a group is one contiguous run of values) and channels innermost (channels-last and
// channels-last-3d: each position a row of C values, a group a run of columns); the output has x's layout, as
// eager's group norm gives.

#include "common.h"

#include <cmath>
#include <vector>

namespace mindiesd_cpu {
namespace {

// Values summed in float32 vectors before they are added into the double totals.
constexpr int64_t kChunk = 64 * kBlock;

struct Moments {
  float mean;
  float inv_std;
};

// Mean and 1 / sqrt(variance + eps) of the ``count`` contiguous values at ``p``: sums of (v - shift) and of its
// square, with ``shift`` the first value (the shifted-data form: no cancellation where the mean is large beside the
// deviation), in float32 vectors over chunks and in double across them.
template <typename T>
Moments group_moments(const T* p, int64_t count, float eps) {
  const float shift = static_cast<float>(p[0]);
  const fVec k(shift);
  const int64_t full = count - count % kBlock;
  double sum = 0.0;
  double squares = 0.0;
  for (int64_t start = 0; start < full; start += kChunk) {
    const int64_t stop = std::min(start + kChunk, full);
    fVec s0(0.0f), s1(0.0f), q0(0.0f), q1(0.0f);
    for (int64_t j = start; j < stop; j += kBlock) {
      fVec a, b;
      Io<T>::load(p + j, a, b);
      a = a - k;
      b = b - k;
      s0 = s0 + a;
      s1 = s1 + b;
      q0 = at::vec::fmadd(a, a, q0);
      q1 = at::vec::fmadd(b, b, q1);
    }
    sum += horizontal_sum(s0 + s1);
    squares += horizontal_sum(q0 + q1);
  }
  for (int64_t j = full; j < count; ++j) {
    const double v = static_cast<double>(static_cast<float>(p[j])) - shift;
    sum += v;
    squares += v * v;
  }
  const double mean_shifted = sum / static_cast<double>(count);
  const double variance = std::max(0.0, squares / static_cast<double>(count) - mean_shifted * mean_shifted);
  return {static_cast<float>(shift + mean_shifted), static_cast<float>(1.0 / std::sqrt(variance + eps))};
}

// Contiguous x: out = silu(round_T(x * a + b)) per channel, a = inv_std * weight[c], b = bias[c] - mean * a: the norm's output
// rounded to x's type as eager's group norm returns it, then its SiLU.
template <typename T>
void group_norm_silu_kernel(const Tensor& x, const float* weight, const float* bias, int64_t groups, float eps,
                            Tensor& out) {
  const int64_t batch = x.size(0);
  const int64_t channels = x.size(1);
  const int64_t per_group = channels / groups;
  const int64_t spatial = x.numel() / (batch * channels);
  const int64_t group_size = per_group * spatial;
  const T* in = x.const_data_ptr<T>();
  T* result = out.mutable_data_ptr<T>();
  const bool stream = streams(out);
  const int64_t grain = std::max<int64_t>(1, kParallelElements / std::max<int64_t>(group_size, 1));
  at::parallel_for(0, batch * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t offset = task * group_size;
      const Moments moments = group_moments(in + offset, group_size, eps);
      const int64_t first_channel = (task % groups) * per_group;
      for (int64_t i = 0; i < per_group; ++i) {
        const int64_t c = first_channel + i;
        const float scale = moments.inv_std * (weight != nullptr ? weight[c] : 1.0f);
        const float shift = (bias != nullptr ? bias[c] : 0.0f) - moments.mean * scale;
        const fVec va(scale);
        const fVec vb(shift);
        const T* xr = in + offset + i * spatial;
        T* outr = result + offset + i * spatial;
        for_each_block(0, spatial, stream, [&](const auto& block) {
          auto [u, v] = block.load(xr);
          u = at::vec::fmadd(u, va, vb);
          v = at::vec::fmadd(v, va, vb);
          round_through<T>(u, v);
          block.store(outr, silu(u), silu(v));
        });
      }
    }
    finish_streaming(stream);
  });
}

// Channels innermost: each sample is [S, C] row-major. Per sample, partial per-channel sums of (v - shift) and of
// its square over blocks of rows (in parallel; shift: the first value of the channel's group), combined per group
// in double; then each row normalised, scaled and activated with per-channel factors.
template <typename T>
void group_norm_silu_channels_last(const Tensor& x, const float* weight, const float* bias, int64_t groups,
                                   float eps, Tensor& out) {
  const int64_t batch = x.size(0);
  const int64_t channels = x.size(1);
  const int64_t per_group = channels / groups;
  const int64_t spatial = x.numel() / (batch * channels);
  const T* in = x.const_data_ptr<T>();
  T* result = out.mutable_data_ptr<T>();
  const int64_t rows_per_block = std::max<int64_t>(1, kParallelElements / channels);
  const int64_t blocks = (spatial + rows_per_block - 1) / rows_per_block;
  std::vector<float> scale(batch * channels);
  std::vector<float> shift(batch * channels);
  std::vector<double> sums(blocks * channels);
  std::vector<double> squares(blocks * channels);
  std::vector<float> center(channels);
  for (int64_t n = 0; n < batch; ++n) {
    const T* sample = in + n * spatial * channels;
    for (int64_t c = 0; c < channels; ++c) {
      center[c] = static_cast<float>(sample[(c / per_group) * per_group]);
    }
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> s(channels);
      std::vector<float> q(channels);
      for (int64_t block = begin; block < end; ++block) {
        std::fill(s.begin(), s.end(), 0.0f);
        std::fill(q.begin(), q.end(), 0.0f);
        const int64_t last = std::min(spatial, (block + 1) * rows_per_block);
        for (int64_t r = block * rows_per_block; r < last; ++r) {
          const T* row = sample + r * channels;
          int64_t c = 0;
          for (; c + kBlock <= channels; c += kBlock) {
            fVec a, b;
            Io<T>::load(row + c, a, b);
            a = a - fVec::loadu(center.data() + c);
            b = b - fVec::loadu(center.data() + c + kLanes);
            (fVec::loadu(s.data() + c) + a).store(s.data() + c);
            (fVec::loadu(s.data() + c + kLanes) + b).store(s.data() + c + kLanes);
            at::vec::fmadd(a, a, fVec::loadu(q.data() + c)).store(q.data() + c);
            at::vec::fmadd(b, b, fVec::loadu(q.data() + c + kLanes)).store(q.data() + c + kLanes);
          }
          for (; c < channels; ++c) {
            const float v = static_cast<float>(row[c]) - center[c];
            s[c] += v;
            q[c] += v * v;
          }
        }
        for (int64_t c = 0; c < channels; ++c) {
          sums[block * channels + c] = s[c];
          squares[block * channels + c] = q[c];
        }
      }
    });
    const double count = static_cast<double>(spatial * per_group);
    for (int64_t g = 0; g < groups; ++g) {
      double sum = 0.0;
      double square = 0.0;
      for (int64_t block = 0; block < blocks; ++block) {
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
          sum += sums[block * channels + c];
          square += squares[block * channels + c];
        }
      }
      const double mean_shifted = sum / count;
      const double variance = std::max(0.0, square / count - mean_shifted * mean_shifted);
      const float mean = static_cast<float>(center[g * per_group] + mean_shifted);
      const float inv_std = static_cast<float>(1.0 / std::sqrt(variance + eps));
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        const float factor = inv_std * (weight != nullptr ? weight[c] : 1.0f);
        scale[n * channels + c] = factor;
        shift[n * channels + c] = (bias != nullptr ? bias[c] : 0.0f) - mean * factor;
      }
    }
  }
  const bool stream = streams(out);
  at::parallel_for(0, batch * spatial, rows_per_block, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* factors = scale.data() + (row / spatial) * channels;
      const float* offsets = shift.data() + (row / spatial) * channels;
      const T* xr = in + row * channels;
      T* outr = result + row * channels;
      for_each_block(0, channels, stream, [&](const auto& block) {
        auto [u, v] = block.load(xr);
        const auto [fu, fv] = block.load(factors);
        const auto [ou, ov] = block.load(offsets);
        u = at::vec::fmadd(u, fu, ou);
        v = at::vec::fmadd(v, fv, ov);
        round_through<T>(u, v);
        block.store(outr, silu(u), silu(v));
      });
    }
    finish_streaming(stream);
  });
}

bool covers_parameter(const std::optional<Tensor>& p, int64_t channels) {
  return !p.has_value() || !p->defined() ||
         (on_cpu(*p) && is_covered_float(p->scalar_type()) && p->dim() == 1 && p->size(0) == channels);
}

}  // namespace

std::optional<Tensor> group_norm_silu(const Tensor& x, int64_t groups, const std::optional<Tensor>& weight,
                                      const std::optional<Tensor>& bias, double eps) {
  if (!on_cpu(x) || !is_covered_float(x.scalar_type()) || x.dim() < 2 || groups <= 0 || x.size(1) % groups != 0 ||
      !covers_parameter(weight, x.size(1)) || !covers_parameter(bias, x.size(1))) {
    return std::nullopt;
  }
  // x's layout (the strides of torch.empty_like(x): dense, so x's own)
  return channel_op(x, x.scalar_type(), [&](Tensor& out, bool contiguous) {
    Tensor weight_holder;
    Tensor bias_holder;
    const float* w = channel_values(weight, weight_holder);
    const float* b = channel_values(bias, bias_holder);
    dispatch_float(x.scalar_type(), [&](auto tag) {
      if (contiguous) {
        group_norm_silu_kernel<decltype(tag)>(x, w, b, groups, static_cast<float>(eps), out);
      } else {
        group_norm_silu_channels_last<decltype(tag)>(x, w, b, groups, static_cast<float>(eps), out);
      }
    });
  });
}

namespace {

// The executor's entry (entries.h): group_norm_silu(x, groups, weight, bias, eps).
const EntryRegistrar kGroupNormSiluEntry("group_norm_silu", [](const EntryArgs& a) {
  return mindiesd_cpu::group_norm_silu(a.tensor(0), a.to_int(1), a.optional_tensor(2), a.optional_tensor(3),
                                       a.to_double(4));
});

}  // namespace

}  // namespace mindiesd_cpu
