// Sixteen-float lane vectors shared by dorarl's C++ CPU kernels (the engine's, the trainer's):
// loads, stores, a lane sum in a fixed order and exp of non-positive lanes. The builder
// (dorarl/engine/cpu_kernels.py) copies this header beside every source it builds.
#pragma once

#include <cstdint>
#include <cstring>

namespace dorarl {

constexpr int64_t kLanes = 16;
// GCC vector extension: elementwise semantics whatever the ISA flags, so the order of every
// sum below is the code's; the flags only choose the instructions (and FMA contraction).
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// Lane sum by a fixed halving tree: 16 -> 8 -> 4 -> 2 -> 1 (lane i adds lane i + width).
inline float lane_sum(Lanes v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
  return v[0];
}

// exp on 16 lanes, x <= 0 (scores minus their max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p a degree-7 Taylor polynomial (relative error ~2e-8 on that range, under float rounding).
// Our own code, so the result is the same on every call, machine and thread count.
inline Lanes exp_nonpositive(Lanes x) {
  const Ints low = x < -87.0f;  // where 2^n would fall below the normal range: 0
  x = low ? Lanes{} - 87.0f : x;
  // n = round(x log2 e); x <= 0, so truncating x log2 e - 1/2 towards zero rounds it.
  const Ints n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, Ints);
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187045e-06f;
  Lanes p = Lanes{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Ints bits = (n + 127) << 23;
  Lanes two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return low ? Lanes{} : p * two_n;
}

}  // namespace dorarl
