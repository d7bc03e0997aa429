// The packed products of notebook 11: y = x @ W.T with W kept in llama.cpp's block formats.
//
// Why a hand-written kernel: decoding one token reads every weight once, so the bytes per
// weight set the speed -- but only if turning 4 or 8 bits back into a float costs less than
// the bytes it saves. PyTorch's compiled reduction over the packed bytes ran at 0.8-0.95x
// float32's weights per second (notebook 11); here 16 weights are unpacked per instruction
// (AVX-512) and each unpacked weight serves every input row of the tile.
//
// The arithmetic is float32 throughout (no 8-bit activations, unlike llama.cpp), so the
// result equals F.linear(x, dequantize(W)) up to float32 rounding:
//   Q8_0:  w = d * q                         y = sum_b d_b * sum_j q_j x_j
//   Q4_1:  w = d * q + m                     y = sum_b d_b * sum_j q_j x_j  +  sum_b m_b * sum_j x_j
//   Q4_0:  w = d * (q - 8) = d * q - 8 d     the Q4_1 sum with m_b = -8 d_b
// The "offset" sum_b m_b * (sum of x over block b) needs each block's sum of x once per call.
//
// Layout (minillm.model.quant): qs [out, blocks, 32] int8 (Q8_0) or [out, blocks, 16] uint8
// (Q4: byte j holds weight j in its low nibble, weight j + 16 in its high one); d, m [out,
// blocks] float16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MINILLM_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 32;

// float16 -> float32 in one instruction where the CPU has F16C (c10::Half's portable
// conversion is a dozen integer operations, more than the block's own arithmetic).
inline float to_float(const at::Half* h) {
#if defined(__F16C__)
  return _cvtsh_ss(*reinterpret_cast<const uint16_t*>(h));
#else
  return static_cast<float>(*h);
#endif
}

struct Matrix {          // one quantized weight matrix
  const uint8_t* qs;     // the packed integers
  const at::Half* d;     // one scale per block
  const at::Half* m;     // Q4_1's minimums (nullptr otherwise)
  int64_t out, blocks;
  bool four_bit;
  bool q4_0;             // offset = -8 d
  int64_t block_bytes() const { return four_bit ? 16 : 32; }
};

// Offset of output row o for one input row: sum over blocks of m_b * (sum of x over block b).
float offset(const Matrix& w, int64_t o, const float* xsum) {
  if (!w.four_bit) return 0.0f;
  float s = 0.0f;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const float d = to_float(w.d + o * w.blocks + b);
    const float m = w.q4_0 ? -8.0f * d : to_float(w.m + o * w.blocks + b);
    s += m * xsum[b];
  }
  return s;
}

// Input rows up to which the packed product beats "dequantize, then a float matrix product":
// with more rows each weight is reused enough for MKL's better arithmetic to win. Measured on
// the course machine (SmolLM2's shapes): at 8 rows the packed product took 0.5-0.9x the time of
// float32's, at 64 rows 1.4-2.2x.
constexpr int64_t kPackedRows = 32;

#if defined(MINILLM_AVX512)

// Block b of output row o as two vectors of integer-valued floats: weights 0..15 and 16..31.
inline void unpack(const Matrix& w, int64_t o, int64_t b, __m512& lo, __m512& hi) {
  const uint8_t* p = w.qs + (o * w.blocks + b) * w.block_bytes();
  if (w.four_bit) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

// Ask for block b of row o (the next tile's) before it is needed: the rows of a matrix are
// short streams (288 bytes for most of SmolLM2's 4-bit rows, 768 for down_proj), too short for the CPU's own prefetcher
// to run ahead of, and every weight comes from memory once per token.
inline void prefetch(const Matrix& w, int64_t o, int64_t b) {
  if (o >= w.out) return;
  _mm_prefetch(reinterpret_cast<const char*>(w.qs + (o * w.blocks + b) * w.block_bytes()), _MM_HINT_T0);
  if (b % 32 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(w.d + o * w.blocks + b), _MM_HINT_T0);
    if (w.m) _mm_prefetch(reinterpret_cast<const char*>(w.m + o * w.blocks + b), _MM_HINT_T0);
  }
}

inline __m512 scale(const Matrix& w, int64_t o, int64_t b) {
  return _mm512_set1_ps(to_float(w.d + o * w.blocks + b));
}

// O output rows times R input rows: O * R accumulators of 16 lanes, each block unpacked once
// and used R times. One row (decode): sum q x first, then one multiply by d per block.
// The blocks go by in chunks of 16, whose scales are converted to float32 16 at a time.
template <int O, int R>
void tile(const Matrix& w, const float* x, int64_t in, const float* xsum, float* y, int64_t o0) {
  __m512 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  alignas(64) float scales[O][16];
  for (int64_t chunk = 0; chunk < w.blocks; chunk += 16) {
    const int64_t n = std::min<int64_t>(16, w.blocks - chunk);
    for (int o = 0; o < O; ++o) {
      const __m256i d16 = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1),
                                                   w.d + (o0 + o) * w.blocks + chunk);
      _mm512_store_ps(scales[o], _mm512_cvtph_ps(d16));
    }
    for (int64_t b = chunk; b < chunk + n; ++b) {
      __m512 x_lo[R], x_hi[R];
      for (int r = 0; r < R; ++r) {
        x_lo[r] = _mm512_loadu_ps(x + r * in + b * kBlock);
        x_hi[r] = _mm512_loadu_ps(x + r * in + b * kBlock + 16);
      }
      for (int o = 0; o < O; ++o) {
        prefetch(w, o0 + O + o, b);
        __m512 lo, hi;
        unpack(w, o0 + o, b, lo, hi);
        const __m512 d = _mm512_set1_ps(scales[o][b - chunk]);
        if (R == 1) {
          const __m512 qx = _mm512_fmadd_ps(hi, x_hi[0], _mm512_mul_ps(lo, x_lo[0]));
          acc[o][0] = _mm512_fmadd_ps(qx, d, acc[o][0]);
        } else {
          lo = _mm512_mul_ps(lo, d);
          hi = _mm512_mul_ps(hi, d);
          for (int r = 0; r < R; ++r)
            acc[o][r] = _mm512_fmadd_ps(hi, x_hi[r], _mm512_fmadd_ps(lo, x_lo[r], acc[o][r]));
        }
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r)
      y[r * w.out + o0 + o] = _mm512_reduce_add_ps(acc[o][r]) + offset(w, o0 + o, xsum + r * w.blocks);
}

// Output rows [begin, end) of the float matrix the blocks stand for, w = d q + offset.
void dequantize_rows(const Matrix& w, float* out, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m512 lo, hi;
      unpack(w, o, b, lo, hi);
      const __m512 d = scale(w, o, b);
      const float m = !w.four_bit ? 0.0f : w.q4_0 ? -8.0f * to_float(w.d + o * w.blocks + b)
                                                   : to_float(w.m + o * w.blocks + b);
      float* dst = out + (o * w.blocks + b) * kBlock;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(lo, d, _mm512_set1_ps(m)));
      _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(hi, d, _mm512_set1_ps(m)));
    }
}

#else  // portable: the same sums, one weight at a time (the compiler vectorizes what it can)

template <int O, int R>
void tile(const Matrix& w, const float* x, int64_t in, const float* xsum, float* y, int64_t o0) {
  for (int o = 0; o < O; ++o) {
    const int64_t row = o0 + o;
    float acc[R] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* p = w.qs + (row * w.blocks + b) * w.block_bytes();
      const float d = to_float(w.d + row * w.blocks + b);
      for (int j = 0; j < kBlock; ++j) {
        const float q = w.four_bit ? static_cast<float>(j < 16 ? (p[j] & 15) : (p[j - 16] >> 4))
                                   : static_cast<float>(static_cast<int8_t>(p[j]));
        for (int r = 0; r < R; ++r) acc[r] += d * q * x[r * in + b * kBlock + j];
      }
    }
    for (int r = 0; r < R; ++r) y[r * w.out + row] = acc[r] + offset(w, row, xsum + r * w.blocks);
  }
}

void dequantize_rows(const Matrix& w, float* out, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* p = w.qs + (o * w.blocks + b) * w.block_bytes();
      const float d = to_float(w.d + o * w.blocks + b);
      const float m = !w.four_bit ? 0.0f : w.q4_0 ? -8.0f * d : to_float(w.m + o * w.blocks + b);
      for (int j = 0; j < kBlock; ++j) {
        const float q = w.four_bit ? static_cast<float>(j < 16 ? (p[j] & 15) : (p[j - 16] >> 4))
                                   : static_cast<float>(static_cast<int8_t>(p[j]));
        out[(o * w.blocks + b) * kBlock + j] = d * q + m;
      }
    }
}

#endif

// Output rows [begin, end) for all input rows, in tiles that keep every accumulator and the
// tile's x in the 32 vector registers: 4 input rows at a time, the remainder in 2/1. A single
// input row (decode) walks the weight rows one after another: one sequential stream through
// memory, which is what keeps the 8-bit rows from waiting on it.
void rows(const Matrix& w, const float* x, int64_t n_rows, int64_t in, const float* xsum, float* y,
          int64_t begin, int64_t end) {
  int64_t r = 0;
  auto run = [&](auto r_tile) {
    constexpr int R = decltype(r_tile)::value;
    int64_t o = begin;
    for (; R > 1 && o + 4 <= end; o += 4) tile<4, R>(w, x + r * in, in, xsum + r * w.blocks, y + r * w.out, o);
    for (; o < end; ++o) tile<1, R>(w, x + r * in, in, xsum + r * w.blocks, y + r * w.out, o);
    r += R;
  };
  while (n_rows - r >= 4) run(std::integral_constant<int, 4>{});
  if (n_rows - r >= 2) run(std::integral_constant<int, 2>{});
  if (n_rows - r >= 1) run(std::integral_constant<int, 1>{});
}

at::Tensor linear(const at::Tensor& x, const Matrix& w, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              name, ": x must be a contiguous float32 CPU matrix [rows, in], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == w.blocks * kBlock, name, ": x has ", x.size(1), " features, the weight takes ",
              w.blocks * kBlock, " (", w.blocks, " blocks of 32)");
  const int64_t n_rows = x.size(0), in = x.size(1);
  if (n_rows > kPackedRows) {  // prefill: a float copy of this one matrix, then MKL's product
    at::Tensor weight = at::empty({w.out, in}, x.options());
    float* wp = weight.data_ptr<float>();
    at::parallel_for(0, w.out, 16, [&](int64_t begin, int64_t end) { dequantize_rows(w, wp, begin, end); });
    return at::mm(x, weight.t());
  }
  at::Tensor y = at::empty({n_rows, w.out}, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum(static_cast<size_t>(n_rows * w.blocks), 0.0f);  // each block's sum of x
  if (w.four_bit)
    for (int64_t i = 0; i < n_rows * w.blocks; ++i)
      for (int64_t j = 0; j < kBlock; ++j) xsum[i] += xp[i * kBlock + j];
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.out, 64, [&](int64_t begin, int64_t end) {
    rows(w, xp, n_rows, in, xsum.data(), yp, begin, end);
  });
  return y;
}

void check_blocks(const at::Tensor& qs, const at::Tensor& d, int64_t block_bytes, at::ScalarType type,
                  const char* name) {
  TORCH_CHECK(qs.device().is_cpu() && qs.dim() == 3 && qs.size(2) == block_bytes && qs.scalar_type() == type &&
                  qs.is_contiguous(),
              name, ": qs must be contiguous [out, blocks, ", block_bytes, "] ", type, ", got ", qs.sizes(), " ",
              qs.scalar_type());
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 && d.size(0) == qs.size(0) &&
                  d.size(1) == qs.size(1),
              name, ": d must be contiguous float16 [out, blocks] = ", qs.sizes().slice(0, 2), ", got ", d.sizes(),
              " ", d.scalar_type());
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  check_blocks(qs, d, 32, at::kChar, "q8_0_linear");
  Matrix w{reinterpret_cast<const uint8_t*>(qs.data_ptr<int8_t>()), d.data_ptr<at::Half>(), nullptr, qs.size(0), qs.size(1), false, false};
  return linear(x, w, "q8_0_linear");
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const std::optional<at::Tensor>& m) {
  check_blocks(qs, d, 16, at::kByte, "q4_linear");
  if (m) TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->sizes() == d.sizes(),
                     "q4_linear: m must be contiguous float16 shaped like d ", d.sizes(), ", got ", m->sizes());
  Matrix w{qs.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m ? m->data_ptr<at::Half>() : nullptr,
           qs.size(0), qs.size(1), true, !m};
  return linear(x, w, "q4_linear");
}

}  // namespace

TORCH_LIBRARY(minillm, lib) {
  lib.def("q8_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor");
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor? m) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("q8_0_linear", &q8_0_linear);
  lib.impl("q4_linear", &q4_linear);
}
