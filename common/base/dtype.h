// Element types of weights and KV caches, and scalar conversions to and from float32.
// Compute is always float32; bf16 and f16 are storage formats. Header-only so that
// kernels/ can use it without linking common/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

// Host-and-device functions: the scalar conversions and coders the CUDA kernels share with the
// host's specification, so that both code and decode a value the same way.
#if defined(__CUDACC__)
#define KVWIRE_HOST_DEVICE __host__ __device__
#else
#define KVWIRE_HOST_DEVICE
#endif

namespace kvwire {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

KVWIRE_HOST_DEVICE inline size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

KVWIRE_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
KVWIRE_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

// Accepts kvwire names ("f32", "bf16", "f16") and safetensors / torch spellings
// ("F32", "BF16", "F16", "float32", "bfloat16", "float16").
inline absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "f32" || name == "F32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "BF16" || name == "bfloat16") return DType::kBF16;
  if (name == "f16" || name == "F16" || name == "float16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", name, "'; expected one of f32, bf16, f16"));
}

// IEEE binary16 conversions in software (F16C would do, but this keeps the reference
// path portable; the hot paths convert bf16, which is a shift).
KVWIRE_HOST_DEVICE inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | mant << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

KVWIRE_HOST_DEVICE inline uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow -> inf
  if (abs < 0x38800000u) {                        // subnormal or zero
    if (abs < 0x33000000u) return sign;           // underflow
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (113 - e) - 1
    uint32_t half = m >> (shift);
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);  // round to nearest even
  return static_cast<uint16_t>(sign | (r >> 13));
}

inline void ToFloat(DType type, const void* src, float* dst, size_t n) {
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

inline void FromFloat(DType type, const float* src, void* dst, size_t n) {
  switch (type) {
    case DType::kF32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i]);
      return;
    }
  }
}

}  // namespace kvwire
