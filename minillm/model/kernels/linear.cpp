// y = x @ W.T in float32 for the few rows of a batched decode step (notebook 10).
//
// A decode step at batch B multiplies B rows by every weight matrix. The library GEMMs are
// tuned for large matrices: for 2-16 rows they spend their time packing and re-reading the
// weights, and the step reads the weights at a fraction of the memory's speed. Here each weight
// row is read once from memory, used by every input row while it is in registers:
//
//   for a tile of R weight rows (outputs) and MR input rows:
//     for k in steps of 16:  acc[m][r] += x[m][k:k+16] * w[r][k:k+16]     (MR x R registers)
//     y[m][r] = the 16 lanes of acc[m][r] summed
//
// MR x R is chosen to fill the 32 vector registers (8 rows x 3 outputs, 4 x 6, 2 x 8, ...);
// more than 8 input rows run as several row tiles over the same weight tile, which is still in
// the L1 cache. One input row (batch 1) is a plain dot product per weight row instead
// (``one_row``). The sums run in a different order than MKL's, so results agree with F.linear
// to float32 rounding, not bit for bit.
//
// Layout: x [rows, in] and w [out, in], contiguous float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace {

#ifdef MINILLM_AVX512
using minillm_simd::sum16;

// y[m][n0 + r] for m < MR, r < R: one tile, any K (the last 16 or fewer inputs masked).
template <int MR, int R>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0) {
  constexpr int T = MR * R;  // accumulators, in registers: every loop over them is unrolled
  __m512 acc[T];
#pragma GCC unroll 32
  for (int i = 0; i < T; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wr[r] = _mm512_maskz_loadu_ps(mask, w + (n0 + r) * K + k);
      // the next tile's rows, one tile ahead: the hardware prefetcher alone leaves the cores waiting
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + R + r) * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_maskz_loadu_ps(mask, x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_fmadd_ps(xm, wr[r], acc[m * R + r]);
    }
  }
  alignas(64) float sums[32];
  __m512 group[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) group[j] = j < T ? acc[j] : _mm512_setzero_ps();
  _mm512_store_ps(sums, sum16(group));
  if constexpr (T > 16) {
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) group[j] = 16 + j < T ? acc[16 + j] : _mm512_setzero_ps();
    _mm512_store_ps(sums + 16, sum16(group));
  }
  for (int i = 0; i < T; ++i) y[(i / R) * N + n0 + i % R] = sums[i];
}

// The rows of R in a tile for MR input rows: as many outputs as the 32 registers hold.
constexpr int outputs_per_tile(int MR) { return MR <= 3 ? 8 : MR == 4 ? 6 : MR <= 6 ? 4 : 3; }


#elif defined(MINILLM_AVX2)
using minillm_simd::first_lanes;
using minillm_simd::sum8;

// The AVX2 tile: the same loop on 8 lanes, with 16 registers (MR x R accumulators, R weight
// vectors and one input vector: ``outputs_per_tile`` below keeps them within 16).
template <int MR, int R>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0) {
  constexpr int T = MR * R;
  __m256 acc[T];
#pragma GCC unroll 16
  for (int i = 0; i < T; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256i mask = _mm256_castps_si256(first_lanes(static_cast<int>(std::min<int64_t>(8, K - k))));
    __m256 wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wr[r] = _mm256_maskload_ps(w + (n0 + r) * K + k, mask);
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + R + r) * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 xm = _mm256_maskload_ps(x + m * K + k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m * R + r] = _mm256_fmadd_ps(xm, wr[r], acc[m * R + r]);
    }
  }
  alignas(32) float sums[16];
  __m256 group[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) group[j] = j < T ? acc[j] : _mm256_setzero_ps();
  _mm256_store_ps(sums, sum8(group));
  if constexpr (T > 8) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) group[j] = 8 + j < T ? acc[8 + j] : _mm256_setzero_ps();
    _mm256_store_ps(sums + 8, sum8(group));
  }
  for (int i = 0; i < T; ++i) y[(i / R) * N + n0 + i % R] = sums[i];
}

constexpr int outputs_per_tile(int MR) { return MR == 1 ? 6 : MR == 2 ? 4 : MR == 3 ? 3 : MR <= 6 ? 2 : 1; }


#endif

#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)

// One input row (a batch-1 decode step): each core streams its weight rows one after another,
// front to back, with no software prefetch, in 256-bit loads even where AVX-512 exists. On an
// AMD EPYC with AVX-512 (2 cores) the model's 211 products took 17-18 ms a token through the
// tiles above (rows side by side, prefetching ahead), 22 ms on one core with 512-bit loads, and
// 11-12 ms this way: one sequential stream per core is what the hardware prefetcher follows best.
void one_row(const float* x, const float* w, float* y, int64_t K, int64_t n_begin, int64_t n_end) {
  const int64_t full = K - K % 16;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(wn + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(wn + k + 8), a1);
    }
    const __m256 a = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (int64_t k = full; k < K; ++k) sum += x[k] * wn[k];  // the last K % 16 inputs
    y[n] = sum;
  }
}

// Outputs [n0, n0 + R) for every input row: 8 rows at a time, the weight tile staying in L1.
template <int R>
void all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * K;
    float* ym = y + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: tile<1, R>(xm, w, ym, K, N, n0); break;
      case 2: tile<2, std::min(R, outputs_per_tile(2))>(xm, w, ym, K, N, n0); break;
      case 3: tile<3, std::min(R, outputs_per_tile(3))>(xm, w, ym, K, N, n0); break;
      case 4: tile<4, std::min(R, outputs_per_tile(4))>(xm, w, ym, K, N, n0); break;
      case 5: tile<5, std::min(R, outputs_per_tile(5))>(xm, w, ym, K, N, n0); break;
      case 6: tile<6, std::min(R, outputs_per_tile(6))>(xm, w, ym, K, N, n0); break;
      case 7: tile<7, std::min(R, outputs_per_tile(7))>(xm, w, ym, K, N, n0); break;
      default: tile<8, std::min(R, outputs_per_tile(8))>(xm, w, ym, K, N, n0); break;
    }
  }
}

// Outputs [n_begin, n_end) for every input row: tiles of R outputs, then one at a time.
template <int R>
void outputs(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n_begin,
             int64_t n_end) {
  int64_t n = n_begin;
  for (; n + R <= n_end; n += R) all_rows<R>(x, w, y, M, K, N, n);
  for (; n < n_end; ++n) all_rows<1>(x, w, y, M, K, N, n);
}

void run(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end) {
  if (M == 1) return one_row(x, w, y, K, n_begin, n_end);
  switch (outputs_per_tile(static_cast<int>(std::min<int64_t>(M, 8)))) {
    case 8: return outputs<8>(x, w, y, M, K, N, n_begin, n_end);
    case 6: return outputs<6>(x, w, y, M, K, N, n_begin, n_end);
    case 4: return outputs<4>(x, w, y, M, K, N, n_begin, n_end);
    case 3: return outputs<3>(x, w, y, M, K, N, n_begin, n_end);
    case 2: return outputs<2>(x, w, y, M, K, N, n_begin, n_end);
    default: return outputs<1>(x, w, y, M, K, N, n_begin, n_end);
  }
}
#endif

// The portable version: the same order of work, plain loops.
void portable(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n_begin,
              int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * w[n * K + k];
      y[m * N + n] = sum;
    }
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "f32_linear: x must be a contiguous float32 CPU matrix [rows, in], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
              "f32_linear: w must be a contiguous float32 CPU matrix [out, in], got ", w.scalar_type(), " ",
              w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "f32_linear: x has ", x.size(1), " features, the weight takes ", w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // each task: a stretch of outputs for every input row, so each weight row is read by one core, once
  at::parallel_for(0, N, 48, [&](int64_t begin, int64_t end) {
#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)
    run(xp, wp, yp, M, K, N, begin, end);
#else
    portable(xp, wp, yp, M, K, N, begin, end);
#endif
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, lib) {
  lib.def("f32_linear(Tensor x, Tensor w) -> Tensor");
  // Whether the library was built with vector versions (AVX-512 or AVX2): without them the float32
  // kernels are portable loops, slower than PyTorch's own paths, and the callers keep those.
  lib.def("vectorized() -> bool", []() -> bool {
#if defined(MINILLM_AVX512) || defined(MINILLM_AVX2)
    return true;
#else
    return false;
#endif
  });
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("f32_linear", &f32_linear);
}
