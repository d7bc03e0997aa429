// The packed products of notebook 11: y = x @ W.T with W kept in llama.cpp's block formats.
//
// Why a hand-written kernel: decoding one token reads every weight once, so the bytes per
// weight set the speed -- but only if turning 4 or 8 bits back into a float costs less than
// the bytes it saves, which PyTorch's compiled reduction over the packed bytes did not manage
// (notebook 11); here 16 weights are unpacked per instruction (AVX-512) and each unpacked
// weight serves every input row of the tile.
//
// The arithmetic is float32 throughout (no 8-bit activations, unlike llama.cpp), so the
// result equals F.linear(x, dequantize(W)) up to float32 rounding:
//   Q8_0:  w = d * q                  y = sum_b d_b * sum_j q_j x_j   (d applied once per block)
//   Q4_1:  w = d * q + m              each block's 16 possible weights d * k + m (k = 0..15) are
//   Q4_0:  w = d * (q - 8)            computed once, and every 4-bit q *selects* its weight from
//                                     them (one permute instruction for 16 weights), then one FMA.
// The table lookup is what makes 4 bits cheap: turning q into a float by arithmetic (widen,
// convert, scale, add the minimum) costs more instructions per weight than the bytes it saves.
//
// Layout (minillm.model.quant): qs [out, blocks, 32] int8 (Q8_0) or [out, blocks, 16] uint8
// (Q4: byte j holds weight j in its low nibble, weight j + 16 in its high one); d, m [out,
// blocks] float16.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using minillm_kernels::kBlock;
using minillm_kernels::Matrix;
using minillm_kernels::to_float;

enum class Format { q8_0, q4_0, q4_1 };  // the block formats, as template arguments of the kernels

// Input rows up to which the packed product beats "dequantize, then a float matrix product":
// with more rows each weight is reused enough for MKL's better arithmetic to win (on SmolLM2's
// Q4_1 matrices the packed product still wins at 80 rows and draws level near 96).
constexpr int64_t kPackedRows = 80;

#if defined(MINILLM_AVX512)

// Block b of output row o as two vectors of weights (0..15 and 16..31). A 4-bit block: the
// 16 levels d * k + m in one register, and each packed byte's nibbles pick their weights from
// it (vpermps reads only the low 4 bits of each index, so the low nibble needs no mask). An
// 8-bit block: its integers as floats, *not yet scaled* (the caller applies d once per block).
template <bool FourBit>
inline void weights(const uint8_t* p, float d, float m, __m512& lo, __m512& hi) {
  if constexpr (FourBit) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), levels, _mm512_set1_ps(m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(q, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

// 16 float16 values from p (fewer at the end of a row: the mask) as float32, one instruction.
inline void halves_to_floats(const at::Half* p, int64_t n, float* out) {
  _mm512_store_ps(out, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p)));
}

// O output rows times R input rows: O * R accumulators of 16 lanes, each block turned into
// weights once and used R times. The blocks go by in chunks of 16, whose scales (and
// minimums) are converted to float32 16 at a time. An 8-bit block, for each input row: sum q x
// first, then one multiply by d per block. Each row's sum goes in the same order whatever R is,
// so a row's result does not depend on the rows sharing its call (in every format).
//
// The next tile's rows follow this tile's in memory, O * bytes per block of them: while this
// tile reads block b, the next tile's bytes at the same distance are requested (prefetch): one
// cache line per block for 4-bit rows, two for 8-bit ones (asking for only the first of the two
// leaves the tile waiting on the second). The rows of a matrix are short (288 bytes for most
// of SmolLM2's 4-bit rows), too short for the CPU's own prefetcher to run ahead, and every
// weight comes from memory once per token.
template <Format F, int O, int R>
void tile(const Matrix& w, const float* x, int64_t in, float* y, int64_t o0) {
  constexpr bool FourBit = F != Format::q8_0;
  constexpr int64_t bytes = FourBit ? 16 : 32;  // packed bytes per block
  const int64_t blocks = w.blocks;
  const uint8_t* q = w.qs + o0 * blocks * bytes;                  // row o0 + o starts at q + o * blocks * bytes
  const uint8_t* next = q + O * blocks * bytes;                    // the next tile's first byte
  const bool prefetch = o0 + 2 * O <= w.out;
  __m512 acc[O][R];
#pragma GCC unroll 4
  for (int o = 0; o < O; ++o)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[o][r] = _mm512_setzero_ps();
  alignas(64) float scales[O][16], minimums[O][16];
  for (int64_t chunk = 0; chunk < blocks; chunk += 16) {
    const int64_t n = std::min<int64_t>(16, blocks - chunk);
#pragma GCC unroll 4
    for (int o = 0; o < O; ++o) {
      halves_to_floats(w.d + (o0 + o) * blocks + chunk, n, scales[o]);
      if (F == Format::q4_1) halves_to_floats(w.m + (o0 + o) * blocks + chunk, n, minimums[o]);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w.d + (o0 + O + o) * blocks + chunk), _MM_HINT_T0);
      if (prefetch && F == Format::q4_1)
        _mm_prefetch(reinterpret_cast<const char*>(w.m + (o0 + O + o) * blocks + chunk), _MM_HINT_T0);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = chunk + i;
      if (prefetch)
#pragma GCC unroll 2
        for (int64_t line = 0; line < O * bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + b * O * bytes + line), _MM_HINT_T0);
      __m512 x_lo[R], x_hi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        x_lo[r] = _mm512_loadu_ps(x + r * in + b * kBlock);
        x_hi[r] = _mm512_loadu_ps(x + r * in + b * kBlock + 16);
      }
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) {
        const float d = scales[o][i];
        const float m = F == Format::q4_1 ? minimums[o][i] : F == Format::q4_0 ? -8.0f * d : 0.0f;
        __m512 lo, hi;
        weights<FourBit>(q + (o * blocks + b) * bytes, d, m, lo, hi);
        if (!FourBit) {  // every row as one row alone: sum q x, then one multiply by d
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m512 qx = _mm512_fmadd_ps(hi, x_hi[r], _mm512_mul_ps(lo, x_lo[r]));
            acc[o][r] = _mm512_fmadd_ps(qx, _mm512_set1_ps(d), acc[o][r]);
          }
          continue;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          acc[o][r] = _mm512_fmadd_ps(hi, x_hi[r], _mm512_fmadd_ps(lo, x_lo[r], acc[o][r]));
      }
    }
  }
#pragma GCC unroll 4
  for (int o = 0; o < O; ++o)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) y[r * w.out + o0 + o] = _mm512_reduce_add_ps(acc[o][r]);
}

// Output rows [begin, end) of the float matrix the blocks stand for, row begin at out.
void dequantize_rows(const Matrix& w, float* out, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float d = to_float(w.d + o * w.blocks + b);
      const uint8_t* p = w.qs + (o * w.blocks + b) * w.block_bytes();
      __m512 lo, hi;
      if (w.four_bit) {
        weights<true>(p, d, w.minimum(o, b, d), lo, hi);
      } else {
        weights<false>(p, d, 0.0f, lo, hi);
        lo = _mm512_mul_ps(lo, _mm512_set1_ps(d));
        hi = _mm512_mul_ps(hi, _mm512_set1_ps(d));
      }
      float* dst = out + ((o - begin) * w.blocks + b) * kBlock;
      _mm512_storeu_ps(dst, lo);
      _mm512_storeu_ps(dst + 16, hi);
    }
}

#elif defined(MINILLM_AVX2)
using minillm_simd::reduce_add;

// AVX2 (most x86 laptops and desktops: no AVX-512): 8 lanes and 16 vector registers. A 16-entry
// table lookup would take two 8-entry permutes and a blend per 8 weights, more than turning
// the codes into floats by arithmetic (widen, convert, one FMA with the scale and minimum), so
// here the weights are computed, not looked up. Block b of output row o as four vectors of 8
// weights (0..7, 8..15, 16..23, 24..31); an 8-bit block *not yet scaled*, as above.
template <bool FourBit>
inline void weights(const uint8_t* p, __m256 scale, __m256 minimum, __m256 (&w)[4]) {
  if constexpr (FourBit) {
    const __m256i nibble = _mm256_set1_epi32(15);
    for (int half = 0; half < 2; ++half) {  // bytes 0..7 and 8..15: weights j (low nibble) and j + 16 (high)
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
      w[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, nibble)), scale, minimum);
      w[2 + half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), scale, minimum);
    }
  } else {
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
}

// 8 float16 values from p (fewer at the end of a row) as float32: one instruction for all 8,
// where converting each scale on its own (load, move, convert, broadcast) cost about as many
// instructions per block as turning its 32 codes into weights.
inline void halves_to_floats(const at::Half* p, int64_t n, float* out) {
  if (n == 8) {
    _mm256_store_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(p + i);
}

// As the AVX-512 tile: O output rows times R input rows, each block turned into weights once and
// used R times, two accumulators per pair (two chains of FMAs instead of one long one), the next
// tile's bytes prefetched, the scales (and minimums) converted 8 blocks at a time. With 16
// registers, O shrinks as R grows (``tile_outputs``): a 2 x 4 tile's 16 accumulators would take
// every register and spill to the stack. An 8-bit block is summed
// as q x first, then scaled by d, for any number of rows: each row's sum then goes in the same
// order whatever the tile, so a row's result does not depend on the rows sharing its call.
template <Format F, int O, int R>
void tile(const Matrix& w, const float* x, int64_t in, float* y, int64_t o0) {
  constexpr bool FourBit = F != Format::q8_0;
  constexpr int64_t bytes = FourBit ? 16 : 32;
  const int64_t blocks = w.blocks;
  const uint8_t* q = w.qs + o0 * blocks * bytes;
  const uint8_t* next = q + O * blocks * bytes;
  const bool prefetch = o0 + 2 * O <= w.out;
  __m256 acc[O][R][2];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r][0] = acc[o][r][1] = _mm256_setzero_ps();
  alignas(32) float scales[O][8], minimums[O][8];
  for (int64_t chunk = 0; chunk < blocks; chunk += 8) {
    const int64_t n = std::min<int64_t>(8, blocks - chunk);
    for (int o = 0; o < O; ++o) {
      halves_to_floats(w.d + (o0 + o) * blocks + chunk, n, scales[o]);
      if (F == Format::q4_1) halves_to_floats(w.m + (o0 + o) * blocks + chunk, n, minimums[o]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = chunk + i;
      if (prefetch)
        for (int64_t line = 0; line < O * bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + b * O * bytes + line), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int o = 0; o < O; ++o) {
        const __m256 d = _mm256_broadcast_ss(&scales[o][i]);
        const __m256 m = F == Format::q4_1   ? _mm256_broadcast_ss(&minimums[o][i])
                         : F == Format::q4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                                             : _mm256_setzero_ps();
        __m256 wv[4];
        weights<FourBit>(q + (o * blocks + b) * bytes, d, m, wv);
        const float* xb = x + b * kBlock;
        if (!FourBit) {  // sum q x over the block, then one multiply by d
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const float* xr = xb + r * in;
            __m256 qx = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xr));
            qx = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xr + 8), qx);
            qx = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), qx);
            qx = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), qx);
            acc[o][r][b & 1] = _mm256_fmadd_ps(qx, d, acc[o][r][b & 1]);
          }
          continue;
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k)
            acc[o][r][k & 1] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + r * in + 8 * k), acc[o][r][k & 1]);
      }
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) y[r * w.out + o0 + o] = reduce_add(_mm256_add_ps(acc[o][r][0], acc[o][r][1]));
}

void dequantize_rows(const Matrix& w, float* out, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float d = to_float(w.d + o * w.blocks + b);
      const uint8_t* p = w.qs + (o * w.blocks + b) * w.block_bytes();
      __m256 wv[4];
      if (w.four_bit) {
        weights<true>(p, _mm256_set1_ps(d), _mm256_set1_ps(w.minimum(o, b, d)), wv);
      } else {
        weights<false>(p, _mm256_set1_ps(d), _mm256_setzero_ps(), wv);
        for (int i = 0; i < 4; ++i) wv[i] = _mm256_mul_ps(wv[i], _mm256_set1_ps(d));
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + ((o - begin) * w.blocks + b) * kBlock + 8 * i, wv[i]);
    }
}

#else  // portable: the same sums, one weight at a time (the compiler vectorizes what it can)

// Weight j of block b of output row o.
inline float weight(const Matrix& w, int64_t o, int64_t b, int j, float d, float m) {
  const uint8_t* p = w.qs + (o * w.blocks + b) * w.block_bytes();
  if (!w.four_bit) return d * static_cast<float>(static_cast<int8_t>(p[j]));
  return d * static_cast<float>(j < 16 ? (p[j] & 15) : (p[j - 16] >> 4)) + m;
}

template <Format F, int O, int R>
void tile(const Matrix& w, const float* x, int64_t in, float* y, int64_t o0) {
  for (int o = 0; o < O; ++o) {
    const int64_t row = o0 + o;
    float acc[R] = {};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float d = to_float(w.d + row * w.blocks + b);
      const float m = w.four_bit ? w.minimum(row, b, d) : 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        const float wj = weight(w, row, b, j, d, m);
        for (int r = 0; r < R; ++r) acc[r] += wj * x[r * in + b * kBlock + j];
      }
    }
    for (int r = 0; r < R; ++r) y[r * w.out + row] = acc[r];
  }
}

void dequantize_rows(const Matrix& w, float* out, int64_t begin, int64_t end) {
  for (int64_t o = begin; o < end; ++o)
    for (int64_t b = 0; b < w.blocks; ++b) {
      const float d = to_float(w.d + o * w.blocks + b);
      const float m = w.four_bit ? w.minimum(o, b, d) : 0.0f;
      for (int j = 0; j < kBlock; ++j) out[((o - begin) * w.blocks + b) * kBlock + j] = weight(w, o, b, j, d, m);
    }
}

#endif

// Output rows per tile for R input rows: 4 where the accumulators fit in the registers (all of
// AVX-512's 32), fewer with AVX2's 16 (two per pair: 4 x 1 x 2, 2 x 2 x 2, 1 x 4 x 2).
constexpr int tile_outputs(int R) {
#if defined(MINILLM_AVX2)
  return R >= 4 ? 1 : R == 2 ? 2 : 4;
#else
  return 4;
#endif
}

// Output rows [begin, end) for all input rows, in tiles that keep every accumulator and the
// tile's x in the 32 vector registers: 4 output rows at a time (four independent chains of
// multiply-adds, even for one input row: one chain alone waits on each FMA's latency) times
// 4 input rows, the remainder in 2/1.
template <Format F>
void rows(const Matrix& w, const float* x, int64_t n_rows, int64_t in, float* y, int64_t begin, int64_t end) {
  int64_t r = 0;
  auto run = [&](auto r_tile) {
    constexpr int R = decltype(r_tile)::value;
    constexpr int O = tile_outputs(R);
    int64_t o = begin;
    for (; o + O <= end; o += O) tile<F, O, R>(w, x + r * in, in, y + r * w.out, o);
    for (; o < end; ++o) tile<F, 1, R>(w, x + r * in, in, y + r * w.out, o);
    r += R;
  };
  while (n_rows - r >= 4) run(std::integral_constant<int, 4>{});
  if (n_rows - r >= 2) run(std::integral_constant<int, 2>{});
  if (n_rows - r >= 1) run(std::integral_constant<int, 1>{});
}

// Output rows [begin, end) of one matrix, for all input rows, in the matrix's own format.
void rows_of(const Matrix& w, const float* x, int64_t n_rows, int64_t in, float* y, int64_t begin, int64_t end) {
  if (!w.four_bit)
    rows<Format::q8_0>(w, x, n_rows, in, y, begin, end);
  else if (w.q4_0)
    rows<Format::q4_0>(w, x, n_rows, in, y, begin, end);
  else
    rows<Format::q4_1>(w, x, n_rows, in, y, begin, end);
}

// y[r][o] += the float32 columns' share, sum_k w_cols[k][o] x[r][cols[k]], for output rows
// [begin, end), by the task that computed them: a contiguous, vectorized stretch per column.
void add_columns(const Matrix& w, const float* x, int64_t n_rows, int64_t in, float* y, int64_t begin, int64_t end) {
  for (int64_t r = 0; r < n_rows; ++r)
    for (int64_t k = 0; k < w.n_cols; ++k) {
      const float xk = x[r * in + w.cols[k]];
      const float* wk = w.w_cols + k * w.out;
      float* yr = y + r * w.out;
      for (int64_t o = begin; o < end; ++o) yr[o] += wk[o] * xk;
    }
}

}  // namespace

namespace minillm_kernels {

// x [n_rows, in] times each of several matrices that share it (a layer's q/k/v, or gate/up),
// into ys[i] [n_rows, out_i]. For a decode step the cores split *all* their output rows between
// them in one parallel region (one fork and join instead of one per matrix, and the small k/v
// matrices no longer leave a core idle).
void linears_into(const float* x, int64_t n_rows, int64_t in, const std::vector<Matrix>& ws,
                  const std::vector<float*>& ys) {
  if (n_rows > kPackedRows) {  // prefill: a float copy of one matrix at a time, then MKL's product
    const at::Tensor xt = at::from_blob(const_cast<float*>(x), {n_rows, in}, at::kFloat);
    for (size_t i = 0; i < ws.size(); ++i) {
      const Matrix& w = ws[i];
      at::Tensor weight = at::empty({w.out, in}, at::kFloat);
      float* wp = weight.data_ptr<float>();
      at::parallel_for(0, w.out, 16, [&](int64_t begin, int64_t end) {
        dequantize_rows(w, wp + begin * in, begin, end);
        for (int64_t k = 0; k < w.n_cols; ++k)  // the float columns, added to the copy (zeros in the blocks)
          for (int64_t o = begin; o < end; ++o) wp[o * in + w.cols[k]] += w.w_cols[k * w.out + o];
      });
      at::Tensor y = at::from_blob(ys[i], {n_rows, w.out}, at::kFloat);
      at::mm_out(y, xt, weight.t());
    }
    return;
  }
  int64_t total = 0;  // the matrices' output rows, end to end
  for (const Matrix& w : ws) total += w.out;
  at::parallel_for(0, total, 64, [&](int64_t begin, int64_t end) {
    int64_t first = 0;  // the row of the whole list where matrix i starts
    for (size_t i = 0; i < ws.size(); first += ws[i].out, ++i) {
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + ws[i].out);
      if (lo < hi) {
        rows_of(ws[i], x, n_rows, in, ys[i], lo - first, hi - first);
        if (ws[i].n_cols) add_columns(ws[i], x, n_rows, in, ys[i], lo - first, hi - first);
      }
    }
  });
}

void dequantize_row(const Matrix& w, int64_t row, float* out) {
  dequantize_rows(w, out, row, row + 1);
}

std::vector<at::Tensor> linears(const at::Tensor& x, const std::vector<Matrix>& ws, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              name, ": x must be a contiguous float32 CPU matrix [rows, in], got ", x.sizes(), " ", x.scalar_type());
  const int64_t n_rows = x.size(0), in = x.size(1);
  std::vector<at::Tensor> ys;
  std::vector<float*> outputs;
  for (const Matrix& w : ws) {
    TORCH_CHECK(in == w.blocks * kBlock, name, ": x has ", in, " features, the weight takes ", w.blocks * kBlock,
                " (", w.blocks, " blocks of 32)");
    ys.push_back(at::empty({n_rows, w.out}, x.options()));
    outputs.push_back(ys.back().data_ptr<float>());
  }
  linears_into(x.data_ptr<float>(), n_rows, in, ws, outputs);
  return ys;
}

Matrix blocks(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m, const char* name) {
  const bool eight_bit = qs.scalar_type() == at::kChar;
  const int64_t block_bytes = eight_bit ? 32 : 16;
  TORCH_CHECK(qs.device().is_cpu() && qs.dim() == 3 && qs.size(2) == block_bytes &&
                  (eight_bit || qs.scalar_type() == at::kByte) && qs.is_contiguous(),
              name, ": qs must be contiguous [out, blocks, 32] int8 (Q8_0) or [out, blocks, 16] uint8 (Q4), got ",
              qs.sizes(), " ", qs.scalar_type());
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 && d.size(0) == qs.size(0) &&
                  d.size(1) == qs.size(1) && d.device().is_cpu(),
              name, ": d must be contiguous float16 on the CPU [out, blocks] = ", qs.sizes().slice(0, 2), ", got ", d.sizes(),
              " ", d.scalar_type());
  TORCH_CHECK(!(m && eight_bit), name, ": Q8_0 blocks have no minimums (m)");
  if (m) TORCH_CHECK(m->scalar_type() == at::kHalf && m->is_contiguous() && m->sizes() == d.sizes() && m->device().is_cpu(),
                     name, ": m must be contiguous float16 on the CPU, shaped like d ", d.sizes(), ", got ", m->sizes());
  return Matrix{static_cast<const uint8_t*>(qs.data_ptr()), d.data_ptr<at::Half>(), m ? m->data_ptr<at::Half>() : nullptr,
                qs.size(0), qs.size(1), !eight_bit, !eight_bit && !m};
}

// A matrix's float32 columns (``cols`` int64 [k], ``w_cols`` float32 [k, out]:
// quant.quantize_with_outliers), checked and attached to it.
void attach_columns(Matrix& w, const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& w_cols,
                    const char* name, size_t i) {
  TORCH_CHECK(cols.has_value() == w_cols.has_value(), name, ": matrix ", i, " has ",
              cols ? "cols without w_cols" : "w_cols without cols");
  if (!cols) return;
  TORCH_CHECK(cols->scalar_type() == at::kLong && cols->dim() == 1 && cols->is_contiguous() && cols->device().is_cpu(),
              name, ": cols of matrix ", i, " must be contiguous int64 on the CPU [k], got ", cols->scalar_type(), " ",
              cols->sizes());
  TORCH_CHECK(w_cols->scalar_type() == at::kFloat && w_cols->is_contiguous() && w_cols->dim() == 2 &&
                  w_cols->device().is_cpu() && w_cols->size(0) == cols->size(0) && w_cols->size(1) == w.out,
              name, ": w_cols of matrix ", i, " must be contiguous float32 on the CPU [", cols->size(0), ", ", w.out,
              "], got ", w_cols->scalar_type(), " ", w_cols->sizes());
  const int64_t* cp = cols->data_ptr<int64_t>();
  for (int64_t k = 0; k < cols->size(0); ++k)
    TORCH_CHECK(cp[k] >= 0 && cp[k] < w.blocks * kBlock, name, ": column ", cp[k], " of matrix ", i,
                " is outside its ", w.blocks * kBlock, " inputs");
  w.cols = cp;
  w.w_cols = w_cols->data_ptr<float>();
  w.n_cols = cols->size(0);
}

}  // namespace minillm_kernels

namespace {

using minillm_kernels::attach_columns;
using minillm_kernels::blocks;
using minillm_kernels::linears;

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& w_cols) {
  TORCH_CHECK(qs.scalar_type() == at::kChar, "q8_0_linear: qs must be int8, got ", qs.scalar_type());
  Matrix w = blocks(qs, d, std::nullopt, "q8_0_linear");
  attach_columns(w, cols, w_cols, "q8_0_linear", 0);
  return linears(x, {w}, "q8_0_linear")[0];
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const std::optional<at::Tensor>& m, const std::optional<at::Tensor>& cols,
                     const std::optional<at::Tensor>& w_cols) {
  TORCH_CHECK(qs.scalar_type() == at::kByte, "q4_linear: qs must be uint8, got ", qs.scalar_type());
  Matrix w = blocks(qs, d, m, "q4_linear");
  attach_columns(w, cols, w_cols, "q4_linear", 0);
  return linears(x, {w}, "q4_linear")[0];
}

// Several matrices in any of the three formats (Q8_0: int8 qs; Q4_1: uint8 qs with m; Q4_0:
// uint8 qs without), each with its float32 columns if it has some.
std::vector<at::Tensor> packed_linears(const at::Tensor& x, at::TensorList qs, at::TensorList d,
                                       const c10::List<std::optional<at::Tensor>>& m,
                                       const c10::List<std::optional<at::Tensor>>& cols,
                                       const c10::List<std::optional<at::Tensor>>& w_cols) {
  TORCH_CHECK(qs.size() == d.size() && qs.size() == m.size() && qs.size() == cols.size() &&
                  qs.size() == w_cols.size() && !qs.empty(),
              "packed_linears: one qs, d, m, cols and w_cols per matrix, got ", qs.size(), ", ", d.size(), ", ",
              m.size(), ", ", cols.size(), " and ", w_cols.size());
  std::vector<Matrix> ws;
  for (size_t i = 0; i < qs.size(); ++i) {
    ws.push_back(blocks(qs[i], d[i], m.get(i), "packed_linears"));
    attach_columns(ws.back(), cols.get(i), w_cols.get(i), "packed_linears", i);
  }
  return linears(x, ws, "packed_linears");
}

}  // namespace

TORCH_LIBRARY(minillm, lib) {
  lib.def("q8_0_linear(Tensor x, Tensor qs, Tensor d, Tensor? cols=None, Tensor? w_cols=None) -> Tensor");
  lib.def("q4_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, Tensor? cols=None, Tensor? w_cols=None) -> Tensor");
  lib.def("packed_linears(Tensor x, Tensor[] qs, Tensor[] d, Tensor?[] m, Tensor?[] cols, Tensor?[] w_cols) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("q8_0_linear", &q8_0_linear);
  lib.impl("q4_linear", &q4_linear);
  lib.impl("packed_linears", &packed_linears);
}
