// A whole decoder layer of a decode step in one call: the packed-weight model's step on the CPU.
//
// Why: with packed weights a decode token's products take ~7 ms on the course machine (2 AVX2
// cores), and the compiled step spent another ~2.4 ms *between* them: per layer, inductor's
// Python wrapper called 5 ops and 4 fused loops (the norms, RoPE, the KV write, SiLU * up, the
// residual adds) and looked after ~40 buffers -- about 80 us of Python per layer, a fifth of
// the token. Here the layer is one call; the small element-wise steps run in C++ between the
// products, on rows of a few hundred floats that never leave the cache:
//
//   xn  = norm1(x)
//   q, k, v = xn @ Wq, xn @ Wk, xn @ Wv            (one parallel pass over the three matrices)
//   q, k = rope(q), rope(k); write k, v at the row's slot in the pools
//   h   = x + attention(q, pools, block table) @ Wo
//   hn  = norm2(h)
//   out = h + (silu(hn @ Wg) * (hn @ Wu)) @ Wd     (gate and up in one pass)
//
// The products are quant.cpp's and the attention is paged_attention.cpp's -- the very kernels
// the unfused step calls (for head_dim 64 and 128; other head sizes take the attention's portable
// loop here, PyTorch's formulation there) -- so the layer equals minillm.model.llama.Block to
// float32 rounding: the norms, RoPE and SiLU follow PyTorch's formulas and sum in their own order.
//
// Arguments: x [rows, hidden] (one new token per row); the two norms' weights; the seven
// matrices in the order q, k, v, o, gate, up, down, each as packed_linears takes them (qs, d,
// m, the float32 columns), with an optional bias each; cos, sin [rows, head_dim] (rotate-half
// layout); the layer's pools and the step's write slots, block tables and lengths as
// paged_decode_attention and PagedBatch.write take them.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using minillm_kernels::Matrix;

const char* const kOp = "packed_decoder_layer";
const char* const kNames[7] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

// RMSNorm of each row, as minillm.model.layers.RMSNorm: w * (x / sqrt(mean(x^2) + eps)). The
// sum of squares runs in 8 partial sums (a vector's lanes), not one chain of dependent adds.
void rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float lanes[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += xr[i + j] * xr[i + j];
    float sum = 0.0f;
    for (int j = 0; j < 8; ++j) sum += lanes[j];
    for (; i < n; ++i) sum += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (i = 0; i < n; ++i) out[r * n + i] = w[i] * (xr[i] * scale);
  }
}

// Rotate every head of t [rows, heads, head_dim] by its row's angles, in the rotate-half layout
// (pair i is t[i], t[i + head_dim / 2]): x * cos + rotate_half(x) * sin, as model.rope.apply_rope.
void rope(float* t, const float* cos, const float* sin, int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * head_dim;
    const float* s = sin + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = t + (r * heads + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

// g := silu(g) * u = g * sigmoid(g) * u. The sigmoid is computed from e = exp(-|g|), which never
// overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below.
void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(MINILLM_AVX512)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = minillm_simd::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    const __mmask16 negative = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(negative, one, e), _mm512_add_ps(one, e));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid), _mm512_loadu_ps(u + i)));
  }
#elif defined(MINILLM_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = minillm_simd::exp8(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 negative = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float e = std::exp(-std::fabs(g[i]));
    const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
    g[i] = g[i] * sigmoid * u[i];
  }
}

// y += b (each row), when the matrix has a bias.
void add_bias(at::Tensor& y, const std::optional<at::Tensor>& bias) {
  if (!bias) return;
  const float* b = bias->data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t out = y.size(1);
  for (int64_t r = 0; r < y.size(0); ++r)
    for (int64_t o = 0; o < out; ++o) yp[r * out + o] += b[o];
}

// y += x, element by element (a residual connection).
void add_into(at::Tensor& y, const at::Tensor& x) {
  float* yp = y.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) yp[i] += xp[i];
}

void check_floats(const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape, kOp,
              ": ", what, " must be a contiguous float32 CPU tensor ", at::IntArrayRef(shape), ", got ",
              t.scalar_type(), " ", t.sizes());
}

// Each matrix's inputs and outputs against the layer's sizes, named by the layer they belong to.
void check_shapes(const std::vector<Matrix>& w, int64_t hidden, int64_t head_dim, int64_t n_kv_heads) {
  auto expect = [&](int i, int64_t in, int64_t out) {
    TORCH_CHECK(w[i].blocks * minillm_kernels::kBlock == in && (out < 0 || w[i].out == out), kOp, ": ", kNames[i],
                " is [", w[i].out, ", ", w[i].blocks * minillm_kernels::kBlock, "], expected [",
                out < 0 ? std::string("any") : std::to_string(out), ", ", in, "]");
  };
  TORCH_CHECK(w[0].out % head_dim == 0 && (w[0].out / head_dim) % n_kv_heads == 0, kOp, ": q_proj's ", w[0].out,
              " outputs are not whole heads of ", head_dim, " sharing ", n_kv_heads, " KV heads");
  expect(0, hidden, -1);
  expect(1, hidden, n_kv_heads * head_dim);
  expect(2, hidden, n_kv_heads * head_dim);
  expect(3, w[0].out, hidden);
  expect(4, hidden, -1);
  expect(5, hidden, w[4].out);
  expect(6, w[4].out, hidden);
}

at::Tensor packed_decoder_layer(const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& post_norm,
                                double eps, at::TensorList qs, at::TensorList d,
                                const c10::List<std::optional<at::Tensor>>& m,
                                const c10::List<std::optional<at::Tensor>>& cols,
                                const c10::List<std::optional<at::Tensor>>& w_cols,
                                const c10::List<std::optional<at::Tensor>>& bias, const at::Tensor& cos,
                                const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& write_blocks, const at::Tensor& write_offsets,
                                const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(x.dim() == 2, kOp, ": x must be [rows, hidden] (one new token per row), got ", x.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_floats(x, {rows, hidden}, "x");
  check_floats(input_norm, {hidden}, "input_norm");
  check_floats(post_norm, {hidden}, "post_norm");
  TORCH_CHECK(qs.size() == 7 && d.size() == 7 && m.size() == 7 && cols.size() == 7 && w_cols.size() == 7 &&
                  bias.size() == 7,
              kOp, ": one qs, d, m, cols, w_cols and bias for each of q, k, v, o, gate, up, down (7), got ", qs.size(),
              ", ", d.size(), ", ", m.size(), ", ", cols.size(), ", ", w_cols.size(), " and ", bias.size());
  std::vector<Matrix> w;
  for (size_t i = 0; i < 7; ++i) {
    w.push_back(minillm_kernels::blocks(qs[i], d[i], m.get(i), kNames[i]));
    minillm_kernels::attach_columns(w.back(), cols.get(i), w_cols.get(i), kNames[i], i);
    if (const std::optional<at::Tensor> b = bias.get(i))
      check_floats(*b, {w.back().out}, (std::string(kNames[i]) + "'s bias").c_str());
  }
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous() &&
                  v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(),
              kOp, ": k_pool and v_pool must be contiguous float32 [num_blocks, n_kv_heads, block_size, head_dim] "
              "of one shape, got ", k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t num_blocks = k_pool.size(0), n_kv_heads = k_pool.size(1), block_size = k_pool.size(2),
                head_dim = k_pool.size(3);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && n_kv_heads > 0 && block_size > 0, kOp,
              ": the pools [num_blocks, n_kv_heads, block_size, head_dim] need KV heads, blocks and an even head_dim, got ",
              k_pool.sizes());
  check_shapes(w, hidden, head_dim, n_kv_heads);
  const int64_t n_heads = w[0].out / head_dim;
  // every check before the pools are written: a refused step leaves the cache as it was
  minillm_kernels::check_paged_step(rows, n_heads, head_dim, k_pool, v_pool, block_tables, context_lens, kOp);
  check_floats(cos, {rows, head_dim}, "cos");
  check_floats(sin, {rows, head_dim}, "sin");
  for (const at::Tensor* slot : {&write_blocks, &write_offsets})
    TORCH_CHECK(slot->scalar_type() == at::kLong && slot->is_contiguous() && slot->sizes() == at::IntArrayRef{rows},
                kOp, ": write_blocks and write_offsets must be contiguous int64 [rows=", rows, "], got ",
                slot->scalar_type(), " ", slot->sizes());
  const int64_t* blocks_at = write_blocks.data_ptr<int64_t>();
  const int64_t* offsets_at = write_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(blocks_at[r] >= 0 && blocks_at[r] < num_blocks && offsets_at[r] >= 0 && offsets_at[r] < block_size,
                kOp, ": row ", r, " writes to block ", blocks_at[r], " offset ", offsets_at[r], " of a pool of ",
                num_blocks, " blocks of ", block_size);

  // attention: norm, q/k/v, RoPE, the new key and value into the pools, then read through the tables
  at::Tensor xn = at::empty({rows, hidden}, x.options());
  rms_norm(x.data_ptr<float>(), input_norm.data_ptr<float>(), rows, hidden, static_cast<float>(eps),
           xn.data_ptr<float>());
  std::vector<at::Tensor> qkv = minillm_kernels::linears(xn, {w[0], w[1], w[2]}, kOp);
  for (size_t i = 0; i < 3; ++i) add_bias(qkv[i], bias.get(i));
  rope(qkv[0].data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, n_heads, head_dim);
  rope(qkv[1].data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), rows, n_kv_heads, head_dim);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < n_kv_heads; ++h) {
      const int64_t at = ((blocks_at[r] * n_kv_heads + h) * block_size + offsets_at[r]) * head_dim;
      const int64_t from = (r * n_kv_heads + h) * head_dim;
      std::memcpy(k_pool.data_ptr<float>() + at, qkv[1].data_ptr<float>() + from, head_dim * sizeof(float));
      std::memcpy(v_pool.data_ptr<float>() + at, qkv[2].data_ptr<float>() + from, head_dim * sizeof(float));
    }
  const at::Tensor attended = minillm_kernels::paged_decode_attention(qkv[0].view({rows, n_heads, head_dim}), k_pool,
                                                                      v_pool, block_tables, context_lens);
  at::Tensor h = minillm_kernels::linears(attended.view({rows, n_heads * head_dim}), {w[3]}, kOp)[0];
  add_bias(h, bias.get(3));
  add_into(h, x);

  // feed-forward: norm, gate and up, SiLU(gate) * up, down
  at::Tensor hn = at::empty({rows, hidden}, x.options());
  rms_norm(h.data_ptr<float>(), post_norm.data_ptr<float>(), rows, hidden, static_cast<float>(eps),
           hn.data_ptr<float>());
  std::vector<at::Tensor> gate_up = minillm_kernels::linears(hn, {w[4], w[5]}, kOp);
  add_bias(gate_up[0], bias.get(4));
  add_bias(gate_up[1], bias.get(5));
  silu_mul(gate_up[0].data_ptr<float>(), gate_up[1].data_ptr<float>(), gate_up[0].numel());
  at::Tensor out = minillm_kernels::linears(gate_up[0], {w[6]}, kOp)[0];
  add_bias(out, bias.get(6));
  add_into(out, h);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, lib) {
  lib.def("packed_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qs, Tensor[] d, "
          "Tensor?[] m, Tensor?[] cols, Tensor?[] w_cols, Tensor?[] bias, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
          "Tensor(b!) v_pool, Tensor write_blocks, Tensor write_offsets, Tensor block_tables, Tensor context_lens) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("packed_decoder_layer", &packed_decoder_layer);
}
