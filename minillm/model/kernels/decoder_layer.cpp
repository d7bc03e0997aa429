// A whole decoder layer of a decode step in one call: the packed-weight model's step on the CPU.
//
// Why: with packed weights the products are fast, and a compiled step spent a large share of
// a token *between* them: per layer, inductor's Python wrapper called 5 ops and 4 fused loops
// (the norms, RoPE, the KV write, SiLU * up, the residual adds) and looked after ~40 buffers.
// Here the layer is one call; the small element-wise steps run in C++ between the products, on
// rows of a few hundred floats that never leave the cache:
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
// paged_decode_attention and attention.write_kv take them.
//
// The engine does not call the op once per layer: PackedLayers (below) holds every layer's
// tensors, handed over once, and runs a decode step through all of them in one call -- with
// the embedding table, the final norm and the LM head too (set_ends, logits), token ids to
// logits. One layer's code (run_layer) serves both.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
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
const char* const kClass = "PackedLayers";
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

// y += b for each of `rows` rows of `out` values, when the matrix has a bias (b is not null).
void add_bias(float* y, const float* b, int64_t rows, int64_t out) {
  if (b == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += b[o];
}

// y += x, element by element (a residual connection).
void add_into(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void check_floats(const at::Tensor& t, std::vector<int64_t> shape, const std::string& what, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.sizes() == shape, op,
              ": ", what, " must be a contiguous float32 CPU tensor ", at::IntArrayRef(shape), ", got ",
              t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// One decoder layer's weights as the step reads them: the norms, the seven matrices (q, k, v, o,
// gate, up, down) and their biases (nullptr where a matrix has none).
struct Layer {
  const float* input_norm;
  const float* post_norm;
  float eps;
  std::vector<Matrix> w;
  std::vector<const float*> bias;
  int64_t hidden, n_heads, n_kv_heads, head_dim, ffn;
};

// A layer's tensors (as packed_decoder_layer takes them, the matrix i's at index first + i of
// each list) checked against each other and against n_kv_heads x head_dim: each matrix named
// by its role ("gate_proj is [576, 1536], expected [any, 576]").
Layer layer_of(const at::Tensor& input_norm, const at::Tensor& post_norm, double eps, at::TensorList qs,
               at::TensorList d, const c10::List<std::optional<at::Tensor>>& m,
               const c10::List<std::optional<at::Tensor>>& cols, const c10::List<std::optional<at::Tensor>>& w_cols,
               const c10::List<std::optional<at::Tensor>>& bias, size_t first, int64_t n_kv_heads,
               int64_t head_dim, const char* op) {
  Layer layer{};
  layer.eps = static_cast<float>(eps);
  for (size_t i = 0; i < 7; ++i) {
    layer.w.push_back(minillm_kernels::blocks(qs[first + i], d[first + i], m.get(first + i), kNames[i]));
    minillm_kernels::attach_columns(layer.w.back(), cols.get(first + i), w_cols.get(first + i), kNames[i], i);
    const std::optional<at::Tensor> b = bias.get(first + i);
    if (b) check_floats(*b, {layer.w.back().out}, std::string(kNames[i]) + "'s bias", op);
    layer.bias.push_back(b ? b->data_ptr<float>() : nullptr);
  }
  const std::vector<Matrix>& w = layer.w;
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && n_kv_heads > 0, op,
              ": a layer needs KV heads and an even head_dim, got ", n_kv_heads, " x ", head_dim);
  TORCH_CHECK(w[0].out % head_dim == 0 && (w[0].out / head_dim) % n_kv_heads == 0, op, ": q_proj's ", w[0].out,
              " outputs are not whole heads of ", head_dim, " sharing ", n_kv_heads, " KV heads");
  const int64_t hidden = w[0].blocks * minillm_kernels::kBlock;
  auto expect = [&](int i, int64_t in, int64_t out) {
    TORCH_CHECK(w[i].blocks * minillm_kernels::kBlock == in && (out < 0 || w[i].out == out), op, ": ", kNames[i],
                " is [", w[i].out, ", ", w[i].blocks * minillm_kernels::kBlock, "], expected [",
                out < 0 ? std::string("any") : std::to_string(out), ", ", in, "]");
  };
  expect(1, hidden, n_kv_heads * head_dim);
  expect(2, hidden, n_kv_heads * head_dim);
  expect(3, w[0].out, hidden);
  expect(4, hidden, -1);
  expect(5, hidden, w[4].out);
  expect(6, w[4].out, hidden);
  check_floats(input_norm, {hidden}, "input_norm", op);
  check_floats(post_norm, {hidden}, "post_norm", op);
  layer.input_norm = input_norm.data_ptr<float>();
  layer.post_norm = post_norm.data_ptr<float>();
  layer.hidden = hidden;
  layer.n_heads = w[0].out / head_dim;
  layer.n_kv_heads = n_kv_heads;
  layer.head_dim = head_dim;
  layer.ffn = w[4].out;
  return layer;
}

// The step's tensors, which every layer shares: the rows' angles and write slots, and the block
// tables and lengths the attention reads through.
struct Step {
  int64_t rows;
  const float* cos;
  const float* sin;
  const int64_t* write_blocks;
  const int64_t* write_offsets;
  const at::Tensor& block_tables;
  const at::Tensor& context_lens;
};

// x and the step's tensors against the layer, and one layer's pools against the step: every
// check before any pool is written, so that a refused step leaves the cache as it was.
Step step_of(const Layer& layer, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
             const at::Tensor& write_blocks, const at::Tensor& write_offsets, const at::Tensor& block_tables,
             const at::Tensor& context_lens, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, hidden] (one new token per row), got ", x.sizes());
  const int64_t rows = x.size(0);
  check_floats(x, {rows, layer.hidden}, "x", op);
  check_floats(cos, {rows, layer.head_dim}, "cos", op);
  check_floats(sin, {rows, layer.head_dim}, "sin", op);
  for (const at::Tensor* slot : {&write_blocks, &write_offsets})
    TORCH_CHECK(slot->scalar_type() == at::kLong && slot->is_contiguous() && slot->sizes() == at::IntArrayRef{rows} &&
                    slot->device().is_cpu(),
                op, ": write_blocks and write_offsets must be contiguous int64 CPU tensors [rows=", rows, "], got ",
                slot->scalar_type(), " ", slot->sizes(), " on ", slot->device());
  return Step{rows, cos.data_ptr<float>(), sin.data_ptr<float>(), write_blocks.data_ptr<int64_t>(),
              write_offsets.data_ptr<int64_t>(), block_tables, context_lens};
}

void check_pools(const Layer& layer, const Step& step, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const char* op) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(1) == layer.n_kv_heads && k_pool.size(3) == layer.head_dim, op,
              ": the pools must be [num_blocks, n_kv_heads=", layer.n_kv_heads, ", block_size, head_dim=",
              layer.head_dim, "], got ", k_pool.sizes());
  minillm_kernels::check_paged_step(step.rows, layer.n_heads, layer.head_dim, k_pool, v_pool, step.block_tables,
                                    step.context_lens, op);
  for (int64_t r = 0; r < step.rows; ++r)
    TORCH_CHECK(step.write_blocks[r] >= 0 && step.write_blocks[r] < k_pool.size(0) && step.write_offsets[r] >= 0 &&
                    step.write_offsets[r] < k_pool.size(2),
                op, ": row ", r, " writes to block ", step.write_blocks[r], " offset ", step.write_offsets[r],
                " of a pool of ", k_pool.size(0), " blocks of ", k_pool.size(2));
}

// Room for the layers' intermediate rows, reused by every layer of a step: one allocation, each
// part sized for the largest layer (layers may differ in heads and FFN width, not in hidden size).
struct Scratch {
  at::Tensor storage;
  float *xn, *q, *k, *v, *attended, *h, *gate, *up;
  Scratch(const std::vector<Layer>& layers, int64_t rows) {
    int64_t hidden = 0, q_out = 0, kv = 0, ffn = 0;
    for (const Layer& l : layers) {
      hidden = std::max(hidden, l.hidden);
      q_out = std::max(q_out, l.n_heads * l.head_dim);
      kv = std::max(kv, l.n_kv_heads * l.head_dim);
      ffn = std::max(ffn, l.ffn);
    }
    storage = at::empty({rows * (2 * hidden + 2 * q_out + 2 * kv + 2 * ffn)}, at::kFloat);
    float* at = storage.data_ptr<float>();
    for (auto [field, size] : {std::pair{&xn, hidden}, {&q, q_out}, {&k, kv}, {&v, kv}, {&attended, q_out},
                               {&h, hidden}, {&gate, ffn}, {&up, ffn}}) {
      *field = at;
      at += rows * size;
    }
  }
};

// One layer of the step, x -> out ([rows, hidden] each; they must not overlap), checked already.
void run_layer(const Layer& l, const Step& s, const at::Tensor& k_pool, const at::Tensor& v_pool, const float* x,
               float* out, Scratch& t) {
  const int64_t rows = s.rows, hidden = l.hidden, D = l.head_dim, kv = l.n_kv_heads * D;
  const std::vector<Matrix>& w = l.w;
  // attention: norm, q/k/v, RoPE, the new key and value into the pools, then read through the tables
  rms_norm(x, l.input_norm, rows, hidden, l.eps, t.xn);
  minillm_kernels::linears_into(t.xn, rows, hidden, {w[0], w[1], w[2]}, {t.q, t.k, t.v});
  add_bias(t.q, l.bias[0], rows, w[0].out);
  add_bias(t.k, l.bias[1], rows, kv);
  add_bias(t.v, l.bias[2], rows, kv);
  rope(t.q, s.cos, s.sin, rows, l.n_heads, D);
  rope(t.k, s.cos, s.sin, rows, l.n_kv_heads, D);
  float* k_at = k_pool.data_ptr<float>();
  float* v_at = v_pool.data_ptr<float>();
  const int64_t block_size = k_pool.size(2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < l.n_kv_heads; ++h) {
      const int64_t at = ((s.write_blocks[r] * l.n_kv_heads + h) * block_size + s.write_offsets[r]) * D;
      std::memcpy(k_at + at, t.k + (r * l.n_kv_heads + h) * D, D * sizeof(float));
      std::memcpy(v_at + at, t.v + (r * l.n_kv_heads + h) * D, D * sizeof(float));
    }
  minillm_kernels::attend(t.q, rows, l.n_heads, k_pool, v_pool, s.block_tables, s.context_lens, t.attended);
  minillm_kernels::linears_into(t.attended, rows, w[3].blocks * minillm_kernels::kBlock, {w[3]}, {t.h});
  add_bias(t.h, l.bias[3], rows, hidden);
  add_into(t.h, x, rows * hidden);

  // feed-forward: norm, gate and up, SiLU(gate) * up, down
  rms_norm(t.h, l.post_norm, rows, hidden, l.eps, t.xn);
  minillm_kernels::linears_into(t.xn, rows, hidden, {w[4], w[5]}, {t.gate, t.up});
  add_bias(t.gate, l.bias[4], rows, l.ffn);
  add_bias(t.up, l.bias[5], rows, l.ffn);
  silu_mul(t.gate, t.up, rows * l.ffn);
  minillm_kernels::linears_into(t.gate, rows, l.ffn, {w[6]}, {out});
  add_bias(out, l.bias[6], rows, hidden);
  add_into(out, t.h, rows * hidden);
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
  TORCH_CHECK(qs.size() == 7 && d.size() == 7 && m.size() == 7 && cols.size() == 7 && w_cols.size() == 7 &&
                  bias.size() == 7,
              kOp, ": one qs, d, m, cols, w_cols and bias for each of q, k, v, o, gate, up, down (7), got ", qs.size(),
              ", ", d.size(), ", ", m.size(), ", ", cols.size(), ", ", w_cols.size(), " and ", bias.size());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(1) > 0 && k_pool.size(2) > 0 && k_pool.size(3) > 0 &&
                  k_pool.size(3) % 2 == 0,
              kOp, ": the pools [num_blocks, n_kv_heads, block_size, head_dim] need KV heads, blocks and an even "
              "head_dim, got ", k_pool.sizes());
  const Layer layer = layer_of(input_norm, post_norm, eps, qs, d, m, cols, w_cols, bias, 0, k_pool.size(1),
                               k_pool.size(3), kOp);
  const Step step = step_of(layer, x, cos, sin, write_blocks, write_offsets, block_tables, context_lens, kOp);
  check_pools(layer, step, k_pool, v_pool, kOp);
  Scratch scratch({layer}, step.rows);
  at::Tensor out = at::empty(x.sizes(), x.options());
  run_layer(layer, step, k_pool, v_pool, x.data_ptr<float>(), out.data_ptr<float>(), scratch);
  return out;
}

// Every decoder layer of a packed model, for one call per decode step (the engine's CPU step,
// minillm.engine.runner.KernelLayers): each call of packed_decoder_layer converts 42 tensors
// in six lists, checks them and allocates 10 intermediates, once per layer per step. Here the layers'
// tensors are handed over once, at construction; a step checks its own tensors and every
// layer's pools, then runs the layers back to back in one scratch buffer.
//
// The layers' weights are read through the tensors held here at every step (not through
// pointers taken at construction), so a tensor modified in place, even reallocated
// (``.data = ...``), is what the next step reads; a tensor *replaced* in a module is not seen,
// nor a norm's eps changed (numbers, copied here): the runner checks for both before every step
// (KernelLayers.still_current) and builds a new object.
struct PackedLayers : torch::CustomClassHolder {
  struct Ends {  // the embedding table, the final norm and the LM head (set_ends)
    at::Tensor table_qs, table_d;
    std::optional<at::Tensor> table_m;
    at::Tensor norm;
    double norm_eps;
    at::Tensor head_qs, head_d;
    std::optional<at::Tensor> head_m, head_cols, head_w_cols, head_bias;
  };

  int64_t n_kv_heads, head_dim;
  std::vector<at::Tensor> input_norms, post_norms, qs, d;
  std::vector<double> eps;
  c10::List<std::optional<at::Tensor>> m, cols, w_cols, bias;

  PackedLayers(int64_t n_kv_heads, int64_t head_dim, std::vector<at::Tensor> input_norms,
               std::vector<at::Tensor> post_norms, std::vector<double> eps, std::vector<at::Tensor> qs,
               std::vector<at::Tensor> d, c10::List<std::optional<at::Tensor>> m,
               c10::List<std::optional<at::Tensor>> cols, c10::List<std::optional<at::Tensor>> w_cols,
               c10::List<std::optional<at::Tensor>> bias)
      : n_kv_heads(n_kv_heads), head_dim(head_dim), input_norms(std::move(input_norms)),
        post_norms(std::move(post_norms)), qs(std::move(qs)), d(std::move(d)), eps(std::move(eps)),
        m(std::move(m)), cols(std::move(cols)), w_cols(std::move(w_cols)), bias(std::move(bias)) {
    const size_t n = this->input_norms.size();
    TORCH_CHECK(n > 0 && this->post_norms.size() == n && this->eps.size() == n && this->qs.size() == 7 * n &&
                    this->d.size() == 7 * n && this->m.size() == 7 * n && this->cols.size() == 7 * n &&
                    this->w_cols.size() == 7 * n && this->bias.size() == 7 * n,
                "PackedLayers: for ", n, " layers, two norms and an eps per layer and 7 qs, d, m, cols, w_cols and "
                "bias per layer (", 7 * n, "), got ", this->post_norms.size(), ", ", this->eps.size(), ", ",
                this->qs.size(), ", ", this->d.size(), ", ", this->m.size(), ", ", this->cols.size(), ", ",
                this->w_cols.size(), " and ", this->bias.size());
    layers();  // every layer checked now, so that a bad model is refused before its first step
  }

  int64_t size() const { return static_cast<int64_t>(input_norms.size()); }

  // The packed integers layer i reads (q, k, v, o, gate, up, down): which tensors a step passes.
  std::vector<at::Tensor> matrices(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < size(), "PackedLayers: no layer ", i, " of ", size());
    return {qs.begin() + 7 * i, qs.begin() + 7 * i + 7};
  }

  // Every layer's weights, checked (an error names the layer); the layers may differ in heads and
  // FFN width, not in hidden size (the residual stream they all add to).
  std::vector<Layer> layers() const {
    std::vector<Layer> out;
    for (size_t i = 0; i < input_norms.size(); ++i) {
      try {
        out.push_back(layer_of(input_norms[i], post_norms[i], eps[i], qs, d, m, cols, w_cols, bias, 7 * i,
                               n_kv_heads, head_dim, kClass));
      } catch (const c10::Error& error) {
        TORCH_CHECK(false, "layer ", i, ": ", error.msg());
      }
      TORCH_CHECK(out[i].hidden == out[0].hidden, kClass, ": layer ", i, " takes ", out[i].hidden,
                  " features, layer 0 ", out[0].hidden);
    }
    return out;
  }

  // x [rows, hidden] through every layer, layer i writing its new keys and values into k_pools[i],
  // v_pools[i]: [rows, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                     const at::Tensor& write_blocks, const at::Tensor& write_offsets, const at::Tensor& block_tables,
                     const at::Tensor& context_lens) const {
    const std::vector<Layer> all = layers();
    const Step step = step_of(all[0], x, cos, sin, write_blocks, write_offsets, block_tables, context_lens, kClass);
    return run(all, step, x, k_pools, v_pools);
  }

  // The model's ends, for ``logits``: the embedding table and the LM head in a block format, the
  // final norm's weight and eps (the head's m, columns and bias as a packed matrix has them).
  void set_ends(const at::Tensor& table_qs, const at::Tensor& table_d, const std::optional<at::Tensor>& table_m,
                const at::Tensor& norm, double norm_eps, const at::Tensor& head_qs, const at::Tensor& head_d,
                const std::optional<at::Tensor>& head_m, const std::optional<at::Tensor>& head_cols,
                const std::optional<at::Tensor>& head_w_cols, const std::optional<at::Tensor>& head_bias) {
    const Ends candidate{table_qs, table_d, table_m, norm, norm_eps, head_qs, head_d, head_m, head_cols, head_w_cols,
                         head_bias};
    check_ends(candidate, layers()[0]);  // (a refused set keeps the ends there were)
    ends = candidate;
  }

  // A whole decode step, token_ids [rows] (int64) -> logits [rows, vocab]: the table's rows, every
  // layer (as forward), the final norm and the LM head, in one call (after set_ends). With
  // ``logits_rows`` (int64 [n], row indices), only those rows go through the final norm and the
  // head: logits [n, vocab]. That is how a short prompt runs as this step (runner.prefill): each of
  // its tokens a row with the sequence's block table and its own context length (position + 1),
  // every row's keys and values written before any row attends, the head run for the last token.
  at::Tensor logits(const at::Tensor& token_ids, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                    const at::Tensor& write_blocks, const at::Tensor& write_offsets, const at::Tensor& block_tables,
                    const at::Tensor& context_lens, const std::optional<at::Tensor>& logits_rows) const {
    TORCH_CHECK(ends.has_value(), "PackedLayers.logits: no embedding table and LM head (set_ends)");
    const std::vector<Layer> all = layers();
    const auto [table, head] = check_ends(*ends, all[0]);
    TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.dim() == 1 && token_ids.is_contiguous() &&
                    token_ids.device().is_cpu(),
                "PackedLayers.logits: token_ids must be a contiguous int64 CPU tensor [rows], got ",
                token_ids.scalar_type(), " ", token_ids.sizes(), " on ", token_ids.device());
    const int64_t rows = token_ids.size(0), hidden = all[0].hidden;
    const int64_t* ids = token_ids.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r)
      TORCH_CHECK(ids[r] >= 0 && ids[r] < table.out, "PackedLayers.logits: row ", r, " has token id ", ids[r],
                  ", outside the embedding table's ", table.out, " rows");
    if (logits_rows) {
      TORCH_CHECK(logits_rows->scalar_type() == at::kLong && logits_rows->dim() == 1 && logits_rows->is_contiguous() &&
                      logits_rows->device().is_cpu(),
                  "PackedLayers.logits: logits_rows must be a contiguous int64 CPU tensor [n], got ",
                  logits_rows->scalar_type(), " ", logits_rows->sizes(), logits_rows->is_contiguous() ? "" : " (not contiguous)",
                  " on ", logits_rows->device());
      const int64_t* wanted = logits_rows->data_ptr<int64_t>();
      for (int64_t i = 0; i < logits_rows->size(0); ++i)
        TORCH_CHECK(wanted[i] >= 0 && wanted[i] < rows, "PackedLayers.logits: logits_rows[", i, "] is ", wanted[i],
                    ", not one of the step's ", rows, " rows");
    }
    at::Tensor x = at::empty({rows, hidden}, at::kFloat);
    const Step step = step_of(all[0], x, cos, sin, write_blocks, write_offsets, block_tables, context_lens, kClass);
    for (int64_t r = 0; r < rows; ++r) minillm_kernels::dequantize_row(table, ids[r], x.data_ptr<float>() + r * hidden);
    const at::Tensor h = logits_rows ? run(all, step, x, k_pools, v_pools).index_select(0, *logits_rows)
                                     : run(all, step, x, k_pools, v_pools);
    const int64_t n = h.size(0);
    at::Tensor hn = at::empty({n, hidden}, at::kFloat);
    rms_norm(h.data_ptr<float>(), ends->norm.data_ptr<float>(), n, hidden, static_cast<float>(ends->norm_eps),
             hn.data_ptr<float>());
    at::Tensor out = at::empty({n, head.out}, at::kFloat);
    minillm_kernels::linears_into(hn.data_ptr<float>(), n, hidden, {head}, {out.data_ptr<float>()});
    if (ends->head_bias) add_bias(out.data_ptr<float>(), ends->head_bias->data_ptr<float>(), n, head.out);
    return out;
  }

 private:
  std::optional<Ends> ends;

  // The table and the head as matrices, checked against the layers (read through the tensors at
  // every step, as the layers' are).
  static std::pair<Matrix, Matrix> check_ends(const Ends& ends, const Layer& first) {
    Matrix table = minillm_kernels::blocks(ends.table_qs, ends.table_d, ends.table_m, "the embedding table");
    Matrix head = minillm_kernels::blocks(ends.head_qs, ends.head_d, ends.head_m, "lm_head");
    minillm_kernels::attach_columns(head, ends.head_cols, ends.head_w_cols, "lm_head", 0);
    TORCH_CHECK(table.blocks * minillm_kernels::kBlock == first.hidden && head.blocks == table.blocks,
                "PackedLayers: the embedding table is [", table.out, ", ", table.blocks * minillm_kernels::kBlock,
                "] and lm_head [", head.out, ", ", head.blocks * minillm_kernels::kBlock, "], the layers' hidden size is ",
                first.hidden);
    check_floats(ends.norm, {first.hidden}, "the final norm", kClass);
    if (ends.head_bias) check_floats(*ends.head_bias, {head.out}, "lm_head's bias", kClass);
    return {table, head};
  }

  // The step's checks for every layer's pools (before any is written), then the layers in turn.
  at::Tensor run(const std::vector<Layer>& all, const Step& step, const at::Tensor& x,
                 const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools) const {
    TORCH_CHECK(k_pools.size() == all.size() && v_pools.size() == all.size(), "PackedLayers: ", all.size(),
                " layers need as many k_pools and v_pools, got ", k_pools.size(), " and ", v_pools.size());
    for (size_t i = 0; i < all.size(); ++i) check_pools(all[i], step, k_pools[i], v_pools[i], kClass);
    Scratch scratch(all, step.rows);
    at::Tensor a = at::empty(x.sizes(), x.options()), b = at::empty(x.sizes(), x.options());
    const float* in = x.data_ptr<float>();
    for (size_t i = 0; i < all.size(); ++i) {
      float* out = (i % 2 == 0 ? a : b).data_ptr<float>();
      run_layer(all[i], step, k_pools[i], v_pools[i], in, out, scratch);
      in = out;
    }
    return all.size() % 2 == 1 ? a : b;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(minillm, lib) {
  lib.def("packed_decoder_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor[] qs, Tensor[] d, "
          "Tensor?[] m, Tensor?[] cols, Tensor?[] w_cols, Tensor?[] bias, Tensor cos, Tensor sin, Tensor(a!) k_pool, "
          "Tensor(b!) v_pool, Tensor write_blocks, Tensor write_offsets, Tensor block_tables, Tensor context_lens) "
          "-> Tensor");
  lib.class_<PackedLayers>("PackedLayers")
      .def(torch::init<int64_t, int64_t, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<double>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>,
                       c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>,
                       c10::List<std::optional<at::Tensor>>>())
      .def("size", &PackedLayers::size)
      .def("matrices", &PackedLayers::matrices)
      .def("forward", &PackedLayers::forward)
      .def("set_ends", &PackedLayers::set_ends)
      .def("logits", &PackedLayers::logits, "",
           {torch::arg("token_ids"), torch::arg("cos"), torch::arg("sin"), torch::arg("k_pools"), torch::arg("v_pools"),
            torch::arg("write_blocks"), torch::arg("write_offsets"), torch::arg("block_tables"),
            torch::arg("context_lens"), torch::arg("logits_rows") = c10::IValue()});
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("packed_decoder_layer", &packed_decoder_layer);
}
