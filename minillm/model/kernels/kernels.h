// What one kernel file offers the others: the packed products (quant.cpp) and the paged decode
// attention (paged_attention.cpp), called by the decoder layer (decoder_layer.cpp) as functions,
// without going through PyTorch's dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace minillm_kernels {

constexpr int64_t kBlock = 32;  // weights per block, in every format

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
  bool q4_0;             // m = -8 d
  const int64_t* cols = nullptr;  // input columns kept in float32 beside the blocks (or none)
  const float* w_cols = nullptr;  // their weights, one row per column [n_cols, out]
  int64_t n_cols = 0;
  int64_t block_bytes() const { return four_bit ? 16 : 32; }
  // The block's weight for level 0: Q4_1's minimum, -8 d for Q4_0 (4-bit formats only).
  float minimum(int64_t o, int64_t b, float scale) const {
    return q4_0 ? -8.0f * scale : to_float(m + o * blocks + b);
  }
};

// A matrix's blocks, checked (``name`` is the op that reports a mismatch).
Matrix blocks(const at::Tensor& qs, const at::Tensor& d, const std::optional<at::Tensor>& m, const char* name);

// A matrix's float32 columns (int64 ``cols`` [k], float32 ``w_cols`` [k, out]), checked and attached.
void attach_columns(Matrix& w, const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& w_cols,
                    const char* name, size_t i);

// Row ``row`` of the float matrix the blocks stand for, into out [blocks * 32] (an embedding lookup;
// the float32 columns, which only products have, are not added).
void dequantize_row(const Matrix& w, int64_t row, float* out);

// x [rows, in] float32 times each matrix: one [rows, out_i] result per matrix, in one parallel pass.
std::vector<at::Tensor> linears(const at::Tensor& x, const std::vector<Matrix>& ws, const char* name);

// The same into ys[i] [n_rows, out_i] (unchecked: x has ws[i].blocks * 32 columns, no y overlaps x).
void linears_into(const float* x, int64_t n_rows, int64_t in, const std::vector<Matrix>& ws,
                  const std::vector<float*>& ys);

// That a decode step's pools, block tables and lengths fit ``rows`` queries of ``n_heads`` x
// ``head_dim``: shapes, dtypes, every length within its table and every block within the pool
// (``op`` names the caller in the error).
void check_paged_step(int64_t rows, int64_t n_heads, int64_t head_dim, const at::Tensor& k_pool,
                      const at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const char* op);

// One query per row [rows, n_heads, head_dim] over its keys in the pools, through its block table.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens);

// The same into out [rows, n_heads, head_dim] (unchecked: the caller ran check_paged_step).
void attend(const float* q, int64_t rows, int64_t n_heads, const at::Tensor& k_pool, const at::Tensor& v_pool,
            const at::Tensor& block_tables, const at::Tensor& context_lens, float* out);

}  // namespace minillm_kernels
