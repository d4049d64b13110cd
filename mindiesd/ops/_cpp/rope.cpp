// rope: x * cos + rotate(x) * sin, one row at a time.

#include "common.h"

namespace mindiesd_cpu {
namespace {

// (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): the interleaved rotation.
inline fVec rotate_pairs(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 swapped = _mm512_permute_ps(v, 0xB1);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi64(0x80000000LL));
  return _mm512_xor_ps(swapped, sign);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 swapped = _mm256_permute_ps(v, 0xB1);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi64x(0x80000000LL));
  return _mm256_xor_ps(swapped, sign);
#else
  alignas(64) float in[kLanes];
  alignas(64) float out[kLanes];
  v.store(in);
  for (int64_t i = 0; i < kLanes; i += 2) {
    out[i] = -in[i + 1];
    out[i + 1] = in[i];
  }
  return fVec::loadu(out);
#endif
}

// n <= kLanes / 2 values (p0, p1, ...) -> (p0, p0, p1, p1, ...), zero beyond.
inline fVec load_duplicated(const float* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kLanes / 2) {
    const __m512 v = _mm512_castps256_ps512(_mm256_loadu_ps(p));
    const __m512i index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(index, v);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (n == kLanes / 2) {
    const __m256 v = _mm256_castps128_ps256(_mm_loadu_ps(p));
    const __m256i index = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    return _mm256_permutevar8x32_ps(v, index);
  }
#endif
  alignas(64) float out[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    out[2 * i] = p[i];
    out[2 * i + 1] = p[i];
  }
  return fVec::loadu(out);
}

// The table values of a block of interleaved pairs: per-pair tables hold one
// value per pair (each used twice), full-width ones one per element.
template <bool kPerPair, typename BlockT>
inline std::pair<fVec, fVec> pair_table(const BlockT& block, const float* table) {
  if constexpr (kPerPair) {
    const int64_t pairs = block.n / 2;
    const int64_t first = std::min(pairs, kLanes / 2);
    return {load_duplicated(table + block.j / 2, first),
            load_duplicated(table + block.j / 2 + kLanes / 2, pairs - first)};
  } else {
    return block.load(table);
  }
}

// Interleaved pairs (x[2i], x[2i+1]). Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_interleaved_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const float* cr, const float* sr, float*) {
    for_each_block(0, walk.width, walk.stream, [&](const auto& block) {
      const auto [a, b] = block.load(xr);
      const auto [c0, c1] = pair_table<kPerPair>(block, cr);
      const auto [s0, s1] = pair_table<kPerPair>(block, sr);
      block.store(outr, at::vec::fmadd(rotate_pairs(a), s0, a * c0), at::vec::fmadd(rotate_pairs(b), s1, b * c1));
    });
  };
  for_each_row<TO, TX, float, float>(out, {&x, &cos, &sin}, body);
}

// Half-rotated pairs (x[i], x[i + D/2]). Per-pair tables hold D/2 values.
template <typename TX, typename TO, bool kPerPair>
void rope_half_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  const int64_t half = x.size(-1) / 2;
  const int64_t second_table = kPerPair ? 0 : half;
  auto body = [&](const RowWalk& walk, TO* outr, const TX* xr, const float* cr, const float* sr, float*) {
    for_each_block(0, half, walk.stream, [&](const auto& block) {
      const auto [x1a, x1b] = block.load(xr);
      const auto [x2a, x2b] = block.load(xr + half);
      const auto [c1a, c1b] = block.load(cr);
      const auto [s1a, s1b] = block.load(sr);
      const auto [c2a, c2b] = block.load(cr + second_table);
      const auto [s2a, s2b] = block.load(sr + second_table);
      block.store(outr, at::vec::fmsub(x1a, c1a, x2a * s1a), at::vec::fmsub(x1b, c1b, x2b * s1b));
      block.store(outr + half, at::vec::fmadd(x2a, c2a, x1a * s2a), at::vec::fmadd(x2b, c2b, x1b * s2b));
    });
  };
  for_each_row<TO, TX, float, float>(out, {&x, &cos, &sin}, body);
}

// A rotation table the kernels read: a row table of a covered float dtype, or float64 (Lumina2's complex128
// freqs_cis seen as real pairs) read as float32 when the output is float32 or 16-bit (a float64 output is left to
// the composition): the tables' rounding moves the result by about one float32 step of its largest value.
inline bool covers_rope_table(const Tensor& t, const Tensor& x) {
  return on_cpu(t) && (is_covered_float(t.scalar_type()) || t.scalar_type() == ScalarType::Double) &&
         broadcasts_into_rows(t, x.sizes());
}

}  // namespace

std::optional<Tensor> rope(
    const Tensor& x_in, const Tensor& cos_in, const Tensor& sin_in, bool interleaved, ScalarType out_dtype) {
  if (!covers_rows(x_in, out_dtype)) {
    return std::nullopt;
  }
  const int64_t width = x_in.size(-1);
  if (width % 2 != 0) {
    return std::nullopt;
  }
  // Tables of one value per pair stay compact unless the other table is full width.
  bool per_pair = width > 0;
  for (const Tensor* t : {&cos_in, &sin_in}) {
    if (t->dim() < 1 || !covers_rope_table(*t, x_in)) {
      return std::nullopt;
    }
    const int64_t last = t->size(-1);
    if (last != width && last != width / 2 && last != 1) {
      return std::nullopt;
    }
    if (last == width && last != 1) {
      per_pair = false;
    }
  }
  return row_op(x_in, out_dtype, [&](const Tensor& x, Tensor& out) {
    const int64_t table_width = per_pair ? width / 2 : width;
    // A D/2 table next to a full-width one is widened to full width.
    auto prepare = [&](const Tensor& t) {
      Tensor table = t;
      if (!per_pair && t.size(-1) == width / 2 && width > 1) {
        if (interleaved) {
          table = t.to(ScalarType::Float).repeat_interleave(2, -1);
        } else {
          std::vector<int64_t> twice(t.dim(), 1);  // (t, t) along the last dim
          twice.back() = 2;
          table = t.repeat(twice);
        }
      }
      return as_row_operand(table, x.sizes(), table_width, ScalarType::Float);
    };
    const Tensor cos = prepare(cos_in);
    const Tensor sin = prepare(sin_in);
    dispatch_float(x.scalar_type(), [&](auto x_tag) {
      using TX = decltype(x_tag);
      dispatch_float(out_dtype, [&](auto o_tag) {
        using TO = decltype(o_tag);
        if (interleaved && per_pair) {
          rope_interleaved_kernel<TX, TO, true>(x, cos, sin, out);
        } else if (interleaved) {
          rope_interleaved_kernel<TX, TO, false>(x, cos, sin, out);
        } else if (per_pair) {
          rope_half_kernel<TX, TO, true>(x, cos, sin, out);
        } else {
          rope_half_kernel<TX, TO, false>(x, cos, sin, out);
        }
      });
    });
  });
}

}  // namespace mindiesd_cpu
