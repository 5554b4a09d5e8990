// What the fused CPU calls share (compiled first, before decode_cpu.cpp and cold_cpu.cpp).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

namespace h2o_cpu {
namespace {  // internal linkage: another build in the same process keeps its own

constexpr int kLanes = 8;  // partial sums of a dot product, added in a fixed order

// acc + a · b: one rounding where the build has FMA (whatever the compiler's contraction rules),
// so that a vector path with fused multiply-adds gives the same bits.
inline float mul_add(float a, float b, float acc) {
#ifdef __FMA__
  return std::fma(a, b, acc);
#else
  return acc + a * b;
#endif
}

// A dot product: lane l adds the terms i ≡ l (mod 8) in order, the lanes then added in a fixed tree.
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] = mul_add(q[i + l], static_cast<float>(k[i + l]), acc[l]);
  }
  for (int l = 0; i < d; ++i, ++l) acc[l] = mul_add(q[i], static_cast<float>(k[i]), acc[l]);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// A layer's slots as the calls address them: keys and values (b, Hs, W, d) with unit stride on d,
// scores and positions (b, Hs, W) with unit stride on the slots (the torch backend's block storage
// qualifies, DESIGN.md §2.7).
struct SlotStrides {
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, ss0, ss1, ps0, ps1;
};

inline SlotStrides slot_strides(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& scores,
                                const at::Tensor& positions, const char* fn) {
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, fn, ": keys and values need unit stride on d");
  TORCH_CHECK(scores.stride(2) == 1 && positions.stride(2) == 1, fn, ": scores and positions need unit stride on B");
  return {keys.stride(0),   keys.stride(1),   keys.stride(2),      values.stride(0),    values.stride(1),
          values.stride(2), scores.stride(0), scores.stride(1), positions.stride(0), positions.stride(1)};
}

}  // namespace
}  // namespace h2o_cpu
