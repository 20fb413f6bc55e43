// Stands in for kernels/cuda/cuda_util.cuh where a kernel's .cuh is compiled as host code to run
// on emulated blocks (emulated_block.h): the include path puts this folder first. CUDA's
// qualifiers and the intrinsics the emulated kernels use, on the host.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/base/dtype.h"
#include "emulated_block.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
// Blocks run one at a time, so a function's static is its block's shared array (not refilled
// between blocks: a read before any write would see the last block's values, not garbage).
#define __shared__ static
#define threadIdx (::kvwire::emulated::ThreadIdx())
#define blockIdx (::kvwire::emulated::BlockIdx())
#define blockDim (::kvwire::emulated::BlockDim())
#define __syncthreads() (::kvwire::emulated::SyncThreads())
#define __syncwarp() (::kvwire::emulated::SyncOwnWarp())

using dim3 = kvwire::emulated::Dim3;
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int offset) {
  return kvwire::emulated::ShuffleXor(v, offset);
}
// A load through the read-only path: counted in emulated::misaligned where its address is not
// a multiple of its size (a vector load that would fault on a GPU).
template <typename T>
inline T __ldg(const T* p) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) ++kvwire::emulated::misaligned;
  T v;
  std::memcpy(&v, p, sizeof(T));  // not *p: the host may not read a 16-byte type off alignment
  return v;
}
inline float __bfloat162float(__nv_bfloat16 v) { return kvwire::Bf16ToFloat(v.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return {kvwire::FloatToBf16(v)}; }
inline float __uint_as_float(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t __float_as_uint(float f) { return std::bit_cast<uint32_t>(f); }
inline float __expf(float x) { return std::exp(x); }
template <typename A, typename B>
inline auto min(A a, B b) {
  static_assert(std::is_same_v<A, B>);
  return a < b ? a : b;
}

namespace kvwire::kernels::cuda {
template <typename T>
inline float ToF32(T v);
template <>
inline float ToF32<float>(float v) {
  return v;
}
template <>
inline float ToF32<__nv_bfloat16>(__nv_bfloat16 v) {
  return Bf16ToFloat(v.bits);
}
template <>
inline float ToF32<__half>(__half v) {
  return F16ToFloat(v.bits);
}
template <typename T>
inline T FromF32(float v);
template <>
inline float FromF32<float>(float v) {
  return v;
}
template <>
inline __nv_bfloat16 FromF32<__nv_bfloat16>(float v) {
  return {FloatToBf16(v)};
}
template <>
inline __half FromF32<__half>(float v) {
  return {FloatToF16(v)};
}
template <typename T>
inline T* DynamicShared() {
  return kvwire::emulated::DynamicShared<T>();
}
inline float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
}  // namespace kvwire::kernels::cuda

#include "kernels/cuda/dispatch.cuh"  // the real one, after the element types above
