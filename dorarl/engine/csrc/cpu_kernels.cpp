// The engine's fused CPU kernels (dorarl/engine/cpu_kernels.py builds and loads them): each
// stands for several torch ops inside a decode step, where every op costs tens of
// microseconds whatever its size.
// - paged_decode: for each (decode row, kv head), walk the row's block table in logical order,
//   score its keys against the kv head's query heads, softmax over the whole context, weight
//   the values. Every sum runs in a fixed order over the row's own logical keys, so a row's
//   output depends on nothing else: not its batch companions, not which physical blocks hold
//   its keys, not how the work is split over threads.
// - rms_norm: within two ulps of torch's (its sum of squares in a fixed order of its own).
// - rope: model.rotate's three ops in one, bit for bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace {

constexpr int64_t kMaxGroup = 32;  // query heads per kv head
// Rows of RMSNorm / tokens of RoPE per thread: a decode step's rows run inline (no fork).
constexpr int64_t kRowsPerThread = 64;
using dorarl::exp_nonpositive;
using dorarl::Ints;
using dorarl::kLanes;
using dorarl::lane_sum;
using dorarl::Lanes;
using dorarl::load;
using dorarl::store;

// The kernel's geometry: `chunks` lane vectors per head row (head_dim = 16 * chunks).
struct Shape {
  int64_t heads, kv_heads, per_kv, dim, block_size, num_blocks, width;
};

// One (decode row, kv head): its query rows, and its key / value tiles in logical block order.
struct Task {
  const float* q[kMaxGroup];
  std::vector<const float*> key_tiles, value_tiles;
  int64_t n;  // keys the row attends to
  int64_t block_size;
  float scale;
};

// fn(t, row) for the task's rows t = 0..n-1 in logical order, block by block.
template <int C, typename Fn>
inline void for_each_row(const Task& task, const std::vector<const float*>& tiles, Fn&& fn) {
  for (int64_t j = 0, t = 0; t < task.n; ++j) {
    const int64_t end = std::min(task.n, t + task.block_size);
    for (const float* row = tiles[j]; t < end; ++t, row += C * kLanes) fn(t, row);
  }
}

// scores[g * n + t] = (q_g . key_t) * scale for G query heads; each key row is read once.
template <int C, int G>
void score(const Task& task, const float* const* q, float* scores) {
  Lanes qv[G][C];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) qv[g][c] = load(q[g] + c * kLanes);
  }
  for_each_row<C>(task, task.key_tiles, [&](int64_t t, const float* key) {
    Lanes acc[G] = {};
    for (int c = 0; c < C; ++c) {
      const Lanes k = load(key + c * kLanes);
      for (int g = 0; g < G; ++g) acc[g] += qv[g][c] * k;
    }
    for (int g = 0; g < G; ++g) scores[g * task.n + t] = lane_sum(acc[g]) * task.scale;
  });
}

// out[g] = sum_t probs[g * n + t] value_t / totals[g], t in logical order.
template <int C, int G>
void weigh(const Task& task, const float* probs, const float* totals, float* out) {
  Lanes acc[G][C] = {};
  for_each_row<C>(task, task.value_tiles, [&](int64_t t, const float* value) {
    for (int g = 0; g < G; ++g) {
      const float p = probs[g * task.n + t];
      for (int c = 0; c < C; ++c) acc[g][c] += p * load(value + c * kLanes);
    }
  });
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) store(out + (g * C + c) * kLanes, acc[g][c] / totals[g]);
  }
}

// In place: row[t] = exp(row[t] - max); returns their sum (lane partials, then the lane tree).
float softmax_numerators(float* row, int64_t n) {
  const float top = *std::max_element(row, row + n);
  Lanes partial = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const Lanes e = exp_nonpositive(load(row + t) - top);
    store(row + t, e);
    partial += e;
  }
  if (t < n) {  // the tail through a padded lane vector; its pads clamp to exp(-87) -> 0
    float buf[kLanes];
    std::fill(buf, buf + kLanes, -INFINITY);
    std::copy(row + t, row + n, buf);
    const Lanes e = exp_nonpositive(load(buf) - top);
    store(buf, e);
    std::copy(buf, buf + (n - t), row + t);
    partial += e;
  }
  return lane_sum(partial);
}

// G query heads of one task: scores, softmax, weighted values.
template <int C, int G>
void attend_group(const Task& task, const float* const* q, std::vector<float>& scores,
                  float* out) {
  scores.resize(G * task.n);
  score<C, G>(task, q, scores.data());
  float totals[G];
  for (int g = 0; g < G; ++g) totals[g] = softmax_numerators(&scores[g * task.n], task.n);
  weigh<C, G>(task, scores.data(), totals, out);
}

// A task's query heads in groups of up to 4 (accumulators in registers).
template <int C>
void attend(const Task& task, int64_t per_kv, std::vector<float>& scores, float* out) {
  constexpr int64_t dim = C * kLanes;
  for (int64_t g0 = 0; g0 < per_kv; g0 += 4) {
    const float* const* q = task.q + g0;
    float* o = out + g0 * dim;
    switch (std::min<int64_t>(4, per_kv - g0)) {
      case 1: attend_group<C, 1>(task, q, scores, o); break;
      case 2: attend_group<C, 2>(task, q, scores, o); break;
      case 3: attend_group<C, 3>(task, q, scores, o); break;
      default: attend_group<C, 4>(task, q, scores, o); break;
    }
  }
}

void attend_dim(const Task& task, const Shape& s, std::vector<float>& scores, float* out) {
  switch (s.dim / kLanes) {
    case 1: attend<1>(task, s.per_kv, scores, out); break;
    case 2: attend<2>(task, s.per_kv, scores, out); break;
    case 4: attend<4>(task, s.per_kv, scores, out); break;
    case 8: attend<8>(task, s.per_kv, scores, out); break;
    default: attend<16>(task, s.per_kv, scores, out); break;
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_pool,
                        const at::Tensor& value_pool, const at::Tensor& tables,
                        const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat, "q: CPU float32 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [batch, heads, dim], dim contiguous");
  TORCH_CHECK(key_pool.dim() == 4 && key_pool.is_contiguous() && value_pool.is_contiguous() &&
                  key_pool.sizes() == value_pool.sizes() &&
                  key_pool.scalar_type() == at::kFloat && value_pool.scalar_type() == at::kFloat,
              "pools: contiguous float32 [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong &&
                  context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong,
              "tables [batch, width] and context_lens [batch]: contiguous int64");
  const int64_t batch = q.size(0);
  const Shape s{q.size(1), key_pool.size(1), q.size(1) / key_pool.size(1), q.size(2),
                key_pool.size(2), key_pool.size(0), tables.size(1)};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && key_pool.size(3) == s.dim, "q and pools disagree");
  TORCH_CHECK(s.dim == 16 || s.dim == 32 || s.dim == 64 || s.dim == 128 || s.dim == 256,
              "head_dim: 16, 32, 64, 128 or 256 only");
  TORCH_CHECK(s.per_kv <= kMaxGroup, "at most 32 query heads per kv head");
  TORCH_CHECK(tables.size(0) == batch && context_lens.size(0) == batch, "batch sizes disagree");
  const float* qp = q.const_data_ptr<float>();
  const float* kp = key_pool.const_data_ptr<float>();
  const float* vp = value_pool.const_data_ptr<float>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lens = context_lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= s.width * s.block_size, "context_lens out of range");
    for (int64_t j = 0; j < (lens[b] + s.block_size - 1) / s.block_size; ++j) {
      const int64_t block = tp[b * s.width + j];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "tables: block id out of range");
    }
  }
  at::Tensor out = at::empty({batch, s.heads * s.dim}, q.options());
  float* op = out.mutable_data_ptr<float>();
  const int64_t tile = s.block_size * s.dim;
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    Task task{};
    task.block_size = s.block_size;
    task.scale = static_cast<float>(scale);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t b = index / s.kv_heads, h = index % s.kv_heads;
      task.n = lens[b];
      task.key_tiles.clear();
      task.value_tiles.clear();
      for (int64_t j = 0; j < (task.n + s.block_size - 1) / s.block_size; ++j) {
        const int64_t offset = (tp[b * s.width + j] * s.kv_heads + h) * tile;
        task.key_tiles.push_back(kp + offset);
        task.value_tiles.push_back(vp + offset);
      }
      for (int64_t g = 0; g < s.per_kv; ++g) {
        task.q[g] = qp + b * q.stride(0) + (h * s.per_kv + g) * q.stride(1);
      }
      attend_dim(task, s, scores, op + (b * s.heads + h * s.per_kv) * s.dim);
    }
  });
  return out;
}

// One row of `rms_norm`.
void norm_row(const float* row, const float* wp, int64_t hidden, float eps_f, float* o) {
  Lanes partial = {};
  int64_t d = 0;
  for (; d + kLanes <= hidden; d += kLanes) {
    const Lanes v = load(row + d);
    partial += v * v;
  }
  float squares = lane_sum(partial);
  for (; d < hidden; ++d) squares += row[d] * row[d];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps_f);
  for (d = 0; d + kLanes <= hidden; d += kLanes) {
    store(o + d, (load(row + d) * inv) * load(wp + d));
  }
  for (; d < hidden; ++d) o[d] = (row[d] * inv) * wp[d];
}

// RMSNorm of each row of x `[rows, hidden]`: (x * (1 / sqrt(mean(x^2) + eps))) * weight, the
// operation order of torch's rms_norm; only the sum of squares is ours (lane partials, then
// the lane tree), so a row's result is its own, whatever rows share the call.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x: contiguous CPU float32 [rows, hidden]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 1 && weight.size(0) == x.size(1),
              "weight: contiguous float32 [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * hidden, wp, hidden, eps_f, op + r * hidden);
  });
  return out;
}

// One head row of `rope`: the products and the sum rounded apart (no fused multiply-add).
__attribute__((optimize("fp-contract=off"))) void rope_row(const float* in, const float* c,
                                                           const float* sn, int64_t dim,
                                                           float* o) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    const float a = in[d] * c[d];
    const float b = in[d + half] * sn[d];
    o[d] = a + b;
  }
  for (int64_t d = half; d < dim; ++d) {
    const float a = in[d] * c[d];
    const float b = in[d - half] * sn[d];
    o[d] = a + b;
  }
}

// Rotate-half RoPE of x `[tokens, heads, dim]` (rows may be strided) with cos and the signed
// sin of model.py (`[tokens, 1, dim]`): x cos + roll(x, dim / 2) sin, each product and the sum
// rounded on their own as torch's three ops round them (no fused multiply-add: bit for bit).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x: CPU float32 [tokens, heads, dim], dim even and contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  for (const at::Tensor* table : {&cos, &sin_signed}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() &&
                    table->numel() == tokens * dim,
                "cos, sin: contiguous float32 [tokens, 1, dim]");
  }
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin_signed.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, tokens, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        rope_row(xp + t * x.stride(0) + h * x.stride(1), cp + t * dim, sp + t * dim, dim,
                 op + (t * heads + h) * dim);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dorarl_cpu, m) {
  m.def(
      "paged_decode(Tensor q, Tensor key_pool, Tensor value_pool, Tensor tables, "
      "Tensor context_lens, float scale) -> Tensor",
      &paged_decode);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("rope(Tensor x, Tensor cos, Tensor sin_signed) -> Tensor", &rope);
}
