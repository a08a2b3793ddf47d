// The fingerprint's row sums on the CPU in one pass (dorarl/runtime/transfer/fingerprint.py
// builds, loads and documents them): s_r = sum_j f_j(y[r, j]) with
// f_j(y) = xs(C2 * xs(C1 * xs(y + T_j))), xs(z) = z ^ (z >> 32), all mod 2^64. The torch ops
// of fingerprint.py make seven passes over an int64 buffer per chunk; this loop reads each
// lane once. Integer sums wrap the same in any order, so the value is the torch ops' exactly.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr uint64_t kC1 = 0xFF51AFD7ED558CCDull;  // murmur3's fmix64 multipliers
constexpr uint64_t kC2 = 0xC4CEB9FE1A85EC53ull;

inline uint64_t xorshift32(uint64_t z) { return z ^ (z >> 32); }

// lanes [rows, width] int64 (contiguous), offsets [width] int64 -> [rows] int64
at::Tensor row_sums(const at::Tensor& lanes, const at::Tensor& offsets) {
  TORCH_CHECK(lanes.device().is_cpu() && offsets.device().is_cpu(), "row_sums: CPU tensors");
  TORCH_CHECK(lanes.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "row_sums: int64 lanes and offsets");
  TORCH_CHECK(lanes.dim() == 2 && lanes.is_contiguous(), "row_sums: contiguous [rows, width]");
  TORCH_CHECK(offsets.dim() == 1 && offsets.is_contiguous() && offsets.size(0) == lanes.size(1),
              "row_sums: one offset per column");
  const int64_t rows = lanes.size(0);
  const int64_t width = lanes.size(1);
  at::Tensor out = at::empty({rows}, lanes.options());
  const auto* y = reinterpret_cast<const uint64_t*>(lanes.data_ptr<int64_t>());
  const auto* t = reinterpret_cast<const uint64_t*>(offsets.data_ptr<int64_t>());
  auto* s = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t* row = y + r * width;
    uint64_t sum = 0;
    for (int64_t j = 0; j < width; ++j) {
      uint64_t z = xorshift32(row[j] + t[j]);
      z = xorshift32(z * kC1);
      sum += xorshift32(z * kC2);
    }
    s[r] = sum;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(dorarl_fingerprint, m) {
  m.def("row_sums(Tensor lanes, Tensor offsets) -> Tensor", &row_sums);
}
