// Decode attention read through the block table, in place: notebook 08's paged cache at the
// speed of the memory.
//
// One new query per row attends to that row's keys, which lie in fixed-size blocks scattered
// over a pool. PyTorch's matrix products need their operands dense, so the simple way copies
// every row's blocks out (a [rows, keys, ...] tensor, in every layer at every step): the cache
// is read twice and written once. Here each block is read where it lies, once, by the loop
// that uses it -- what vLLM's paged-attention kernel does on a GPU.
//
// The softmax runs "online" (Milakov & Gimelshein 2018; FlashAttention): walking the blocks,
// keep per query head the largest score m seen so far, the sum l of exp(score - m) and the
// weighted sum acc of the values; a larger score rescales l and acc by exp(m_old - m_new).
// Nothing of size [keys] is ever stored.
//
// Work is split by rows and by chunks of a row's keys ("split-K", as flash-decoding does), so
// that both cores stay busy even at batch 1. A task walks its keys for every head: a block's
// keys and values for all KV heads lie together in the pool, so it reads them as one stretch
// of memory, and the query heads of a group share their KV head's keys, read once for all of
// them. Each chunk keeps its own (m, l, acc); a last pass merges them:
// out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c. The chunk length depends only on the
// row's own length, so a row's result does not depend on the other rows of the batch or on the
// thread count (batch invariance: batched greedy decoding equals one-by-one, bit for bit).
//
// float32 only (the CPU engine's cache dtype); minillm.model.attention falls back to its
// PyTorch formulation for any other dtype or device.
//
// Layout (minillm.cache.paged): q [rows, n_heads, head_dim]; k_pool, v_pool [num_blocks,
// n_kv_heads, block_size, head_dim]; block_tables [rows, width] int64; context_lens [rows] int64.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

#ifdef MINILLM_AVX512
using minillm_simd::exp_ps;
using minillm_simd::sum16;
#endif
#ifdef MINILLM_AVX2
using minillm_simd::exp8;
using minillm_simd::first_lanes;
using minillm_simd::reduce_add;
using minillm_simd::reduce_max;
using minillm_simd::sum8;
#endif

struct Shape {
  int64_t n_heads, n_kv_heads, groups, head_dim, block_size, width;
  float scale;  // 1 / sqrt(head_dim)
};

// Where one task's partial softmax lives: per query head, the maximum, the sum and the values.
struct Partial {
  float* max;  // [n_heads]
  float* sum;  // [n_heads]
  float* acc;  // [n_heads, head_dim]
};

// Keys per task for a row of `length` keys: about a quarter of the row (so even one row makes
// work for four threads), at least 64 keys (less would spend more on merging than it saves),
// at most 512, and a multiple of 16.
inline int64_t chunk_keys(int64_t length) {
  return std::clamp<int64_t>((length / 4 + 15) / 16 * 16, 64, 512);
}

// Where keys start .. start + 16 of one KV head lie in the pools (each a [head_dim] vector):
// keys[j], values[j]. Those past n point at the first key (a vector version reads them, then masks
// their scores). One division finds the first key's block; the others follow it, block by block.
inline void locate16(const Shape& sh, const float* k_pool, const float* v_pool, const int64_t* table, int64_t start,
                     int n, int64_t kv_head, const float* (&keys)[16], const float* (&values)[16]) {
  const int64_t B = sh.block_size, D = sh.head_dim, head_stride = B * D, block_stride = sh.n_kv_heads * head_stride;
  const float* k_head = k_pool + kv_head * head_stride;
  const float* v_head = v_pool + kv_head * head_stride;
  int64_t block = start / B, in_block = start % B, at = table[block] * block_stride + in_block * D;
  for (int j = 0; j < n; ++j) {
    keys[j] = k_head + at;
    values[j] = v_head + at;
    at += D;
    if (++in_block == B && j + 1 < n) {  // the next key opens the next block of the table
      in_block = 0;
      at = table[++block] * block_stride;
    }
  }
  for (int j = n; j < 16; ++j) {
    keys[j] = keys[0];
    values[j] = values[0];
  }
}

#ifdef MINILLM_AVX512
// Keys [first, last) of one row for every head, 16 keys at a time wherever they lie, for
// head_dim = D (a multiple of 16): the 16 scores of a query head land in one register, so the
// softmax bookkeeping (maximum, exp, sum) is a handful of vector instructions per 16 keys, and
// the head's running output stays in registers while the 16 values are added in.
template <int D>
void attend_chunk16(const Shape& sh, const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
                    int64_t first, int64_t last, Partial out, float* p, float* keep) {
  constexpr int V = D / 16;       // registers per head vector
  constexpr int H = 16 / V;       // query heads whose outputs fit in 16 registers
  const __m512 scale = _mm512_set1_ps(sh.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const float* keys[16];
  const float* values[16];
  for (int64_t start = first; start < last; start += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, last - start));
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t kv_head = 0; kv_head < sh.n_kv_heads; ++kv_head) {
      locate16(sh, k_pool, v_pool, table, start, n, kv_head, keys, values);
      // scores and softmax bookkeeping for each query head of the group sharing these keys
      const int64_t first_head = kv_head * sh.groups;
      for (int64_t g = 0; g < sh.groups; ++g) {
        const int64_t head = first_head + g;
        __m512 qv[V], t[16];
#pragma GCC unroll 8
        for (int i = 0; i < V; ++i) qv[i] = _mm512_loadu_ps(q + head * D + 16 * i);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          t[j] = _mm512_setzero_ps();
          if (j < n)
#pragma GCC unroll 8
            for (int i = 0; i < V; ++i) t[j] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(keys[j] + 16 * i), t[j]);
        }
        const __m512 s = _mm512_mask_blend_ps(valid, minus_inf, _mm512_mul_ps(sum16(t), scale));
        const float new_max = std::max(out.max[head], _mm512_reduce_max_ps(s));
        keep[g] = std::exp(out.max[head] - new_max);  // rescales what was summed so far (0 at the start)
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
        out.sum[head] = out.sum[head] * keep[g] + _mm512_reduce_add_ps(e);
        out.max[head] = new_max;
        _mm512_storeu_ps(p + g * 16, e);
      }
      // the weighted values: each value vector loaded once for up to H heads of the group
      for (int64_t g0 = 0; g0 < sh.groups; g0 += H) {
        const int heads = static_cast<int>(std::min<int64_t>(H, sh.groups - g0));
        float* acc_g0 = out.acc + (first_head + g0) * D;
        __m512 acc[H][V];
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
          for (int i = 0; i < V; ++i)
            acc[h][i] = h < heads ? _mm512_mul_ps(_mm512_set1_ps(keep[g0 + h]), _mm512_loadu_ps(acc_g0 + h * D + 16 * i))
                                  : _mm512_setzero_ps();
        for (int j = 0; j < n; ++j) {
          __m512 v[V];
#pragma GCC unroll 8
          for (int i = 0; i < V; ++i) v[i] = _mm512_loadu_ps(values[j] + 16 * i);
#pragma GCC unroll 8
          for (int h = 0; h < H; ++h) {
            if (h < heads) {
              const __m512 w = _mm512_set1_ps(p[(g0 + h) * 16 + j]);
#pragma GCC unroll 8
              for (int i = 0; i < V; ++i) acc[h][i] = _mm512_fmadd_ps(w, v[i], acc[h][i]);
            }
          }
        }
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h)
          if (h < heads)
#pragma GCC unroll 8
            for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_g0 + h * D + 16 * i, acc[h][i]);
      }
    }
  }
}
#endif

#ifdef MINILLM_AVX2
// The AVX2 version has 16 registers, too few to keep a group's outputs in registers while the
// softmax moves on 16 keys at a time, so it takes the chunk in three passes instead: every
// score of the chunk (p [n_heads, stride], in the L1/L2 cache), then each head's maximum, exps
// and sum over the whole chunk at once, then the values weighted by those probabilities. The
// keys are read in the first pass and the values in the last, each once; the rescaling of the
// online softmax is not needed inside a chunk (a task is one chunk), only in the final merge.
template <int D>
void attend_chunk16(const Shape& sh, const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
                    int64_t first, int64_t last, Partial out, float* p) {
  constexpr int V = D / 8;  // registers per head vector
  const int64_t n_keys = last - first, stride = (n_keys + 15) / 16 * 16;
  const __m256 scale = _mm256_set1_ps(sh.scale);
  const float* keys[16];
  const float* values[16];
  // 1. the scores, 8 keys side by side per query head: each piece of q loaded once for 8 keys
  for (int64_t start = first; start < last; start += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, last - start));
    for (int64_t kv_head = 0; kv_head < sh.n_kv_heads; ++kv_head) {
      locate16(sh, k_pool, v_pool, table, start, n, kv_head, keys, values);
      for (int64_t head = kv_head * sh.groups; head < (kv_head + 1) * sh.groups; ++head) {
        for (int half = 0; half * 8 < n; ++half) {
          __m256 t[8];
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) t[j] = _mm256_setzero_ps();
#pragma GCC unroll 16
          for (int i = 0; i < V; ++i) {
            const __m256 qi = _mm256_loadu_ps(q + head * D + 8 * i);
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j) t[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(keys[8 * half + j] + 8 * i), t[j]);
          }
          _mm256_storeu_ps(p + head * stride + (start - first) + 8 * half, _mm256_mul_ps(sum8(t), scale));
        }
      }
    }
  }
  // 2. per head: the chunk's largest score, then exp(score - max) in place and their sum
  for (int64_t head = 0; head < sh.n_heads; ++head) {
    float* ph = p + head * stride;
    __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i < n_keys; i += 8)
      m = _mm256_max_ps(m, _mm256_blendv_ps(m, _mm256_loadu_ps(ph + i), first_lanes(static_cast<int>(n_keys - i))));
    const float max = reduce_max(m);
    const __m256 mv = _mm256_set1_ps(max);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n_keys; i += 8) {
      const __m256 e = _mm256_and_ps(first_lanes(static_cast<int>(n_keys - i)), exp8(_mm256_sub_ps(_mm256_loadu_ps(ph + i), mv)));
      _mm256_storeu_ps(ph + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    out.max[head] = max;
    out.sum[head] = reduce_add(sum);
  }
  // 3. the weighted values, 16 keys at a time, each query head's output in 8 registers (the
  // values come from the L1 cache again for the next head of the group)
  for (int64_t start = first; start < last; start += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, last - start));
    for (int64_t kv_head = 0; kv_head < sh.n_kv_heads; ++kv_head) {
      locate16(sh, k_pool, v_pool, table, start, n, kv_head, keys, values);
      for (int64_t head = kv_head * sh.groups; head < (kv_head + 1) * sh.groups; ++head) {
        const float* ph = p + head * stride + (start - first);
        float* acc_h = out.acc + head * D;
        __m256 acc[V];
#pragma GCC unroll 16
        for (int i = 0; i < V; ++i) acc[i] = _mm256_loadu_ps(acc_h + 8 * i);
        for (int j = 0; j < n; ++j) {
          const __m256 w = _mm256_set1_ps(ph[j]);
#pragma GCC unroll 16
          for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values[j] + 8 * i), acc[i]);
        }
#pragma GCC unroll 16
        for (int i = 0; i < V; ++i) _mm256_storeu_ps(acc_h + 8 * i, acc[i]);
      }
    }
  }
}
#endif

// The same for any head_dim and any CPU, one key at a time: the reference the fast version
// must agree with (tests run both).
void attend_chunk(const Shape& sh, const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
                  int64_t first, int64_t last, Partial out) {
  const int64_t D = sh.head_dim, B = sh.block_size, head_stride = B * D, block_stride = sh.n_kv_heads * head_stride;
  for (int64_t position = first; position < last; ++position) {
    const int64_t at = table[position / B] * block_stride + (position % B) * D;
    for (int64_t head = 0; head < sh.n_heads; ++head) {
      const float* k = k_pool + at + (head / sh.groups) * head_stride;
      const float* v = v_pool + at + (head / sh.groups) * head_stride;
      float score = 0.0f;
      for (int64_t i = 0; i < D; ++i) score += q[head * D + i] * k[i];
      score *= sh.scale;
      const float new_max = std::max(out.max[head], score);
      const float keep = std::exp(out.max[head] - new_max), p = std::exp(score - new_max);
      out.sum[head] = out.sum[head] * keep + p;
      out.max[head] = new_max;
      float* acc = out.acc + head * D;
      for (int64_t i = 0; i < D; ++i) acc[i] = acc[i] * keep + p * v[i];
    }
  }
}

// One task: start its partial empty, then run the fastest version for this head_dim.
void run_chunk(const Shape& sh, const float* q, const float* k_pool, const float* v_pool, const int64_t* table,
               int64_t first, int64_t last, Partial out, std::vector<float>& scratch) {
  std::fill(out.max, out.max + sh.n_heads, -std::numeric_limits<float>::infinity());
  std::fill(out.sum, out.sum + sh.n_heads, 0.0f);
  std::fill(out.acc, out.acc + sh.n_heads * sh.head_dim, 0.0f);
#ifdef MINILLM_AVX512
  scratch.resize(sh.groups * 17);  // 16 probabilities and a rescale factor per head of a group
  float* p = scratch.data();
  float* keep = p + sh.groups * 16;
  if (sh.head_dim == 64) return attend_chunk16<64>(sh, q, k_pool, v_pool, table, first, last, out, p, keep);
  if (sh.head_dim == 128) return attend_chunk16<128>(sh, q, k_pool, v_pool, table, first, last, out, p, keep);
#endif
#ifdef MINILLM_AVX2
  scratch.resize(sh.n_heads * ((last - first + 15) / 16 * 16));  // the chunk's scores, per query head
  if (sh.head_dim == 64) return attend_chunk16<64>(sh, q, k_pool, v_pool, table, first, last, out, scratch.data());
  if (sh.head_dim == 128) return attend_chunk16<128>(sh, q, k_pool, v_pool, table, first, last, out, scratch.data());
#endif
  attend_chunk(sh, q, k_pool, v_pool, table, first, last, out);
}

}  // namespace

namespace minillm_kernels {

void check_paged_step(int64_t rows, int64_t n_heads, int64_t head_dim, const at::Tensor& k_pool,
                      const at::Tensor& v_pool, const at::Tensor& block_tables, const at::Tensor& context_lens,
                      const char* op) {
  for (const at::Tensor* t : {&k_pool, &v_pool, &block_tables, &context_lens})
    TORCH_CHECK(t->device().is_cpu(), op, ": the pools, block_tables and context_lens must be on the CPU, got ",
                t->device());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.scalar_type() == at::kFloat && k_pool.is_contiguous(), op,
              ": k_pool must be contiguous float32 [num_blocks, n_kv_heads, block_size, head_dim], got ",
              k_pool.scalar_type(), " ", k_pool.sizes());
  TORCH_CHECK(v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == at::kFloat && v_pool.is_contiguous(), op,
              ": v_pool must be contiguous float32 shaped like k_pool ", k_pool.sizes(), ", got ", v_pool.sizes());
  TORCH_CHECK(k_pool.size(3) == head_dim, op, ": head_dim of q (", head_dim, ") and of the pool (", k_pool.size(3),
              ") differ");
  TORCH_CHECK(head_dim > 0 && k_pool.size(2) > 0, op, ": the pools ", k_pool.sizes(),
              " have a head_dim or a block_size of 0");
  TORCH_CHECK(k_pool.size(1) > 0 && n_heads % k_pool.size(1) == 0, op, ": ", n_heads, " query heads cannot share ",
              k_pool.size(1), " KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.size(0) == rows,
              op, ": block_tables must be contiguous int64 [rows=", rows, ", width], got ", block_tables.scalar_type(),
              " ", block_tables.sizes());
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.size(0) == rows,
              op, ": context_lens must be contiguous int64 [rows=", rows, "], got ", context_lens.scalar_type(), " ",
              context_lens.sizes());
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), block_size = k_pool.size(2), num_blocks = k_pool.size(0);
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(lens[row] >= 1 && lens[row] <= width * block_size, op, ": row ", row, " has context length ",
                lens[row], ", outside 1..", width * block_size, " (", width, " blocks of ", block_size, ")");
    for (int64_t i = 0; i < (lens[row] + block_size - 1) / block_size; ++i) {
      const int64_t block = tables[row * width + i];
      TORCH_CHECK(block >= 0 && block < num_blocks, op, ": row ", row, " reads block ", block, " of a pool of ",
                  num_blocks, " blocks");
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "paged_decode_attention",
              ": q must be contiguous float32 [rows, n_heads, head_dim], got ", q.scalar_type(), " ", q.sizes());
  check_paged_step(q.size(0), q.size(1), q.size(2), k_pool, v_pool, block_tables, context_lens,
                   "paged_decode_attention");
  at::Tensor out = at::empty(q.sizes(), q.options());
  attend(q.data_ptr<float>(), q.size(0), q.size(1), k_pool, v_pool, block_tables, context_lens,
         out.data_ptr<float>());
  return out;
}

void attend(const float* qp, int64_t rows, int64_t n_heads, const at::Tensor& k_pool, const at::Tensor& v_pool,
            const at::Tensor& block_tables, const at::Tensor& context_lens, float* op) {
  const int64_t head_dim = k_pool.size(3);
  const Shape sh{n_heads, k_pool.size(1), n_heads / k_pool.size(1), head_dim, k_pool.size(2),
                 block_tables.size(1), 1.0f / std::sqrt(static_cast<float>(head_dim))};
  const int64_t* lens = context_lens.data_ptr<int64_t>();

  // the tasks: chunks of each row's keys
  struct Chunk { int64_t row, first, last; };
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk(rows + 1);
  for (int64_t row = 0; row < rows; ++row) {
    first_chunk[row] = static_cast<int64_t>(chunks.size());
    const int64_t step = chunk_keys(lens[row]);
    for (int64_t first = 0; first < lens[row]; first += step)
      chunks.push_back({row, first, std::min(first + step, lens[row])});
  }
  first_chunk[rows] = static_cast<int64_t>(chunks.size());
  const int64_t H = sh.n_heads, D = sh.head_dim, partial_floats = H * (2 + D);
  std::vector<float> partials(chunks.size() * static_cast<size_t>(partial_floats));
  auto partial = [&](int64_t chunk) {
    float* base = partials.data() + chunk * partial_floats;
    return Partial{base, base + H, base + 2 * H};
  };

  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Chunk& c = chunks[i];
      run_chunk(sh, qp + c.row * H * D, kp, vp, tables + c.row * sh.width, c.first, c.last, partial(i), scratch);
    }
  });

  // merge each row's chunks: rescale every chunk to the largest maximum, then divide
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t head = 0; head < H; ++head) {
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t c = first_chunk[row]; c < first_chunk[row + 1]; ++c) max = std::max(max, partial(c).max[head]);
      float* o = op + (row * H + head) * D;
      std::fill(o, o + D, 0.0f);
      float total = 0.0f;
      for (int64_t c = first_chunk[row]; c < first_chunk[row + 1]; ++c) {
        const Partial p = partial(c);
        const float weight = std::exp(p.max[head] - max);
        total += weight * p.sum[head];
        for (int64_t i = 0; i < D; ++i) o[i] += weight * p.acc[head * D + i];
      }
      for (int64_t i = 0; i < D; ++i) o[i] /= total;
    }
  }
}

}  // namespace minillm_kernels

TORCH_LIBRARY_FRAGMENT(minillm, lib) {
  lib.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor context_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(minillm, CPU, lib) {
  lib.impl("paged_decode_attention", &minillm_kernels::paged_decode_attention);
}
