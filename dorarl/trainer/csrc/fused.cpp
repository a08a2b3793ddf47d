// The trainer's fused CPU kernels (dorarl/trainer/kernels.py builds them and wraps them in
// autograd functions). Half of a packed forward+backward on the CPU is memory-bound elementwise
// work that torch composes of several ops, each a pass over memory; each kernel here is one:
// - head_stats / head_grad_: the output layer's softmax over one chunk of logits: log-sum-exp,
//   the target's log-prob and the entropy in one pass per row (torch: about nine), and the
//   gradient of a weighted sum of log-prob and entropy written over the logits in one.
// - rms_norm_fwd / rms_norm_bwd: weight * (x / sqrt(mean(x^2) + eps)) and its gradients; the
//   weight's gradient sums fixed blocks of rows, then the blocks in order: the same bits
//   whatever the thread count.
// - silu_mul_fwd / silu_mul_bwd: SwiGLU's silu(gate) * up and its two gradients.
// Float32 in and out; every sum in an order of the code's own (lanes.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "lanes.h"

namespace {

using dorarl::exp_nonpositive;
using dorarl::kLanes;
using dorarl::lane_sum;
using dorarl::Lanes;
using dorarl::load;
using dorarl::store;

constexpr int64_t kNormRows = 32;          // rows per block of the weight gradient's sum
constexpr int64_t kVectorsPerTask = 1024;  // 16K floats of elementwise work per thread task
constexpr float kPad = -88.0f;             // a padded lane's exp argument: exp gives exactly 0

// `count` floats (<= 16) from p; the other lanes hold `pad`.
inline Lanes load_n(const float* p, int64_t count, float pad = 0.0f) {
  if (count == kLanes) return load(p);
  Lanes v = Lanes{} + pad;
  std::memcpy(&v, p, count * sizeof(float));
  return v;
}

inline void store_n(float* p, Lanes v, int64_t count) {
  if (count == kLanes) return store(p, v);
  std::memcpy(p, &v, count * sizeof(float));
}

inline Lanes lanes_of(float x) { return Lanes{} + x; }

// Lanes from `count` on set to kPad, whose exp is exactly 0 (and 0 * kPad is 0).
inline Lanes pad_tail(Lanes v, int64_t count) {
  for (int64_t i = count; i < kLanes; ++i) v[i] = kPad;
  return v;
}

void check_floats(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == dims,
              name, ": contiguous CPU float32 with ", dims, " dims");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK(a.sizes() == b.sizes(), name, ": shape ", b.sizes(), " against ", a.sizes());
}

// One int64 target per row, each a column of the row: their data.
const int64_t* checked_targets(const at::Tensor& targets, int64_t rows, int64_t width) {
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 &&
                  targets.size(0) == rows && targets.is_contiguous(),
              "targets: contiguous int64 [rows]");
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(tp[r] >= 0 && tp[r] < width, "targets: ", tp[r], " outside [0, ", width, ")");
  }
  return tp;
}

float row_max(const float* z, int64_t width) {
  constexpr float low = -std::numeric_limits<float>::infinity();
  Lanes most = lanes_of(low);
  for (int64_t d = 0; d < width; d += kLanes) {
    const Lanes v = load_n(z + d, std::min(kLanes, width - d), low);
    most = v > most ? v : most;
  }
  float m = most[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, most[i]);
  return m;
}

// ---- output layer: softmax statistics and gradient ----

struct RowStats {
  float lse, logp, entropy;
};

// exp(z - max) summed, and weighted by (z - max), over four lane accumulators in turn.
RowStats softmax_row(const float* z, int64_t width, int64_t target) {
  const float m = row_max(z, width);
  Lanes sums[4] = {}, weighted[4] = {};
  for (int64_t d = 0, k = 0; d < width; d += kLanes, k = (k + 1) & 3) {
    const int64_t count = std::min(kLanes, width - d);
    const Lanes x = pad_tail(load_n(z + d, count) - m, count);
    const Lanes e = exp_nonpositive(x);
    sums[k] += e;
    weighted[k] += e * x;
  }
  const float s = lane_sum((sums[0] + sums[1]) + (sums[2] + sums[3]));
  const float t = lane_sum((weighted[0] + weighted[1]) + (weighted[2] + weighted[3]));
  const float log_s = std::log(s);
  // entropy = -sum p (x - log s) = log s - t / s, with p = e / s
  return {m + log_s, (z[target] - m) - log_s, log_s - t / s};
}

// scaled [n, vocab] (logits / T), targets [n] -> (lse, logp, entropy), each [n]
std::tuple<at::Tensor, at::Tensor, at::Tensor> head_stats(const at::Tensor& scaled,
                                                          const at::Tensor& targets) {
  check_floats(scaled, "scaled", 2);
  const int64_t rows = scaled.size(0), width = scaled.size(1);
  const int64_t* tp = checked_targets(targets, rows, width);
  at::Tensor lse = at::empty({rows}, scaled.options());
  at::Tensor logp = at::empty({rows}, scaled.options());
  at::Tensor entropy = at::empty({rows}, scaled.options());
  const float* zp = scaled.const_data_ptr<float>();
  float *lp = lse.mutable_data_ptr<float>(), *gp = logp.mutable_data_ptr<float>();
  float* hp = entropy.mutable_data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowStats s = softmax_row(zp + r * width, width, tp[r]);
      lp[r] = s.lse, gp[r] = s.logp, hp[r] = s.entropy;
    }
  });
  return {lse, logp, entropy};
}

// Over scaled's row in place: scale * d/dz (g_logp * logp_target + g_H * H), where
// d logp_t / dz = onehot(t) - p and dH / dz = -p (log p + H).
void grad_row(float* z, int64_t width, int64_t target, float lse, float entropy, float g_logp,
              float g_entropy, float scale) {
  for (int64_t d = 0; d < width; d += kLanes) {
    const int64_t count = std::min(kLanes, width - d);
    const Lanes log_p = pad_tail(load_n(z + d, count) - lse, count);
    const Lanes p = exp_nonpositive(log_p);
    const Lanes grad = -g_logp * p - g_entropy * (p * (log_p + entropy));
    store_n(z + d, grad * scale, count);
  }
  z[target] += g_logp * scale;
}

void head_grad_(at::Tensor scaled, const at::Tensor& lse, const at::Tensor& targets,
                const at::Tensor& entropy, const at::Tensor& grad_logp,
                const at::Tensor& grad_entropy, double scale) {
  check_floats(scaled, "scaled", 2);
  const int64_t rows = scaled.size(0), width = scaled.size(1);
  for (const auto* t : {&lse, &entropy, &grad_logp, &grad_entropy}) {
    check_floats(*t, "row statistics", 1);
    TORCH_CHECK(t->size(0) == rows, "row statistics: ", t->size(0), " rows against ", rows);
  }
  const int64_t* tp = checked_targets(targets, rows, width);
  float* zp = scaled.mutable_data_ptr<float>();
  const float *lp = lse.const_data_ptr<float>(), *hp = entropy.const_data_ptr<float>();
  const float *gl = grad_logp.const_data_ptr<float>(), *gh = grad_entropy.const_data_ptr<float>();
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      grad_row(zp + r * width, width, tp[r], lp[r], hp[r], gl[r], gh[r], scale_f);
    }
  });
}

// ---- RMSNorm ----

float sum_of_products(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  for (int64_t d = 0; d < n; d += kLanes) {
    const int64_t count = std::min(kLanes, n - d);
    acc += load_n(a + d, count) * load_n(b + d, count);
  }
  return lane_sum(acc);
}

// x [rows, hidden], weight [hidden] -> (y [rows, hidden], rstd [rows]); y = w * (x * rstd),
// the operation order of transformers' RMSNorm modules.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& weight,
                                                double eps) {
  check_floats(x, "x", 2);
  check_floats(weight, "weight", 1);
  TORCH_CHECK(weight.size(0) == x.size(1), "weight: ", weight.size(0), " against ", x.size(1));
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options());
  const float *xp = x.const_data_ptr<float>(), *wp = weight.const_data_ptr<float>();
  float *yp = y.mutable_data_ptr<float>(), *rp = rstd.mutable_data_ptr<float>();
  at::parallel_for(0, rows, kNormRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * hidden;
      const float mean = sum_of_products(row, row, hidden) / static_cast<float>(hidden);
      const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      rp[r] = inv;
      for (int64_t d = 0; d < hidden; d += kLanes) {
        const int64_t count = std::min(kLanes, hidden - d);
        store_n(yp + r * hidden + d, load_n(wp + d, count) * (load_n(row + d, count) * inv),
                count);
      }
    }
  });
  return {y, rstd};
}

// dx_j = r g_j - x_j r^3 (sum_i g_i x_i) / hidden with g = w * dy; dw = sum over rows of
// dy * x * r. Accumulates one block's dy * x * r into `partial`.
void norm_grad_row(const float* dy, const float* x, const float* w, float r, int64_t hidden,
                   float* dx, float* partial) {
  Lanes acc = {};
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d);
    acc += (load_n(w + d, count) * load_n(dy + d, count)) * load_n(x + d, count);
  }
  const float c = lane_sum(acc) * (r * r * r) / static_cast<float>(hidden);
  for (int64_t d = 0; d < hidden; d += kLanes) {
    const int64_t count = std::min(kLanes, hidden - d);
    const Lanes xs = load_n(x + d, count), g = load_n(dy + d, count);
    store_n(dx + d, r * (load_n(w + d, count) * g) - xs * c, count);
    store_n(partial + d, load_n(partial + d, count) + g * (xs * r), count);
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& weight,
                                                const at::Tensor& rstd) {
  check_floats(dy, "dy", 2);
  check_floats(x, "x", 2);
  check_same(x, dy, "dy");
  check_floats(weight, "weight", 1);
  check_floats(rstd, "rstd", 1);
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.size(0) == hidden && rstd.size(0) == rows, "weight / rstd: sizes");
  const int64_t blocks = std::max<int64_t>(1, (rows + kNormRows - 1) / kNormRows);
  at::Tensor dx = at::empty_like(x);
  at::Tensor partials = at::zeros({blocks, hidden}, x.options());
  at::Tensor dw = at::empty_like(weight);
  const float *gp = dy.const_data_ptr<float>(), *xp = x.const_data_ptr<float>();
  const float *wp = weight.const_data_ptr<float>(), *rp = rstd.const_data_ptr<float>();
  float *dxp = dx.mutable_data_ptr<float>(), *pp = partials.mutable_data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = b * kNormRows; r < std::min(rows, (b + 1) * kNormRows); ++r) {
        const int64_t at = r * hidden;
        norm_grad_row(gp + at, xp + at, wp, rp[r], hidden, dxp + at, pp + b * hidden);
      }
    }
  });
  float* dwp = dw.mutable_data_ptr<float>();
  at::parallel_for(0, hidden, 256, [&](int64_t begin, int64_t end) {
    for (int64_t d = begin; d < end; ++d) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) sum += pp[b * hidden + d];
      dwp[d] = sum;
    }
  });
  return {dx, dw};
}

// ---- SwiGLU ----

// sigmoid through exp of a non-positive argument: e = exp(-|g|), 1 / (1 + e) or e / (1 + e).
inline Lanes sigmoid(Lanes g) {
  const Lanes e = exp_nonpositive(g > 0 ? -g : g);
  return (g > 0 ? lanes_of(1.0f) : e) / (1.0f + e);
}

// fn(offset, count) over [0, n) in 16-lane vectors, split over threads.
template <class Fn>
void each_vector(int64_t n, Fn&& fn) {
  const int64_t vectors = (n + kLanes - 1) / kLanes;
  at::parallel_for(0, vectors, kVectorsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) fn(v * kLanes, std::min(kLanes, n - v * kLanes));
  });
}

at::Tensor silu_mul_fwd(const at::Tensor& gate, const at::Tensor& up) {
  check_floats(gate, "gate", gate.dim());
  check_floats(up, "up", gate.dim());
  check_same(gate, up, "up");
  at::Tensor out = at::empty_like(gate);
  const float *gp = gate.const_data_ptr<float>(), *up_p = up.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  each_vector(gate.numel(), [&](int64_t i, int64_t count) {
    const Lanes g = load_n(gp + i, count);
    store_n(op + i, (g * sigmoid(g)) * load_n(up_p + i, count), count);
  });
  return out;
}

// d up = dh * silu(g); d gate = dh * up * s (1 + g (1 - s)), s = sigmoid(g)
std::tuple<at::Tensor, at::Tensor> silu_mul_bwd(const at::Tensor& grad, const at::Tensor& gate,
                                                const at::Tensor& up) {
  check_floats(grad, "grad", gate.dim());
  check_floats(gate, "gate", gate.dim());
  check_floats(up, "up", gate.dim());
  check_same(gate, up, "up");
  check_same(gate, grad, "grad");
  at::Tensor d_gate = at::empty_like(gate), d_up = at::empty_like(up);
  const float *dh = grad.const_data_ptr<float>(), *gp = gate.const_data_ptr<float>();
  const float* up_p = up.const_data_ptr<float>();
  float *dg = d_gate.mutable_data_ptr<float>(), *du = d_up.mutable_data_ptr<float>();
  each_vector(gate.numel(), [&](int64_t i, int64_t count) {
    const Lanes g = load_n(gp + i, count), h = load_n(dh + i, count);
    const Lanes s = sigmoid(g);
    store_n(du + i, h * (g * s), count);
    store_n(dg + i, (h * load_n(up_p + i, count)) * (s * (1.0f + g * (1.0f - s))), count);
  });
  return {d_gate, d_up};
}

}  // namespace

TORCH_LIBRARY(dorarl_trainer, m) {
  m.def("head_stats(Tensor scaled, Tensor targets) -> (Tensor, Tensor, Tensor)", &head_stats);
  m.def(
      "head_grad_(Tensor(a!) scaled, Tensor lse, Tensor targets, Tensor entropy, "
      "Tensor grad_logp, Tensor grad_entropy, float scale) -> ()",
      &head_grad_);
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)", &rms_norm_fwd);
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)",
        &rms_norm_bwd);
  m.def("silu_mul_fwd(Tensor gate, Tensor up) -> Tensor", &silu_mul_fwd);
  m.def("silu_mul_bwd(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)", &silu_mul_bwd);
}
