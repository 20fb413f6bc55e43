// How K and V rows are coded on the wire: the cache's own dtype (`auto`, as before formats
// existed), bf16, fp8 (E4M3), int8 or int4. This is the specification: the encoders and
// decoders here are the reference every faster path is tested against.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/dtype.h"

namespace kvwire {

enum class KvFormat : uint8_t { kAuto = 0, kBF16 = 1, kFP8 = 2, kInt8 = 3, kInt4 = 4 };

inline constexpr KvFormat kAllKvFormats[] = {KvFormat::kAuto, KvFormat::kBF16, KvFormat::kFP8,
                                             KvFormat::kInt8, KvFormat::kInt4};

absl::string_view KvFormatName(KvFormat f);
// "auto", "bf16", "fp8" (or "fp8_e4m3", vLLM's spelling), "int8", "int4".
absl::StatusOr<KvFormat> ParseKvFormat(absl::string_view name);
// "auto, bf16, fp8, int8, int4", for messages and help.
const char* KvFormatNames();

// Keys and values are coded differently, as KIVI (§3) found they must be: keys have channels
// of large, slowly varying values (RoPE's low frequencies) beside small ones, so a key is
// quantised per channel over a group of tokens; values per token. The sizes below are the
// specification's constants (docs/algorithms.md, "KV formats", says how they were chosen).
//
// A cache head's tokens are cut into groups fixed by the number it keeps (KvGroups): groups of
// kKeyGroupTokens tokens from its first, and its last kKeyRecentTokens kept tokens a group of
// their own (so that the latest tokens, which local heads read, are coded within their own
// narrow range); the tokens decode appends after them are groups of kKeyGroupTokens again.
// Because the groups belong to the head and not to the wire's chunks, a decode node keeps the
// codes as they arrive, however the stream was cut (docs/wire_format.md).
//
// Keys, per channel and group two f16 parameters; a block (one head's rows of a wire chunk) is
// every row's codes, then the parameters of every group it touches, [group][channel]{a, b},
// each computed over the whole group:
//   auto  the rows as the cache holds them, no parameters
//   bf16  bf16 rows, no parameters
//   fp8   a byte per value, E4M3 of (x − centre) / scale; a = centre (max + min) / 2, b = scale
//         max|x − centre| / 448
//   int8  a byte per value, round((x − min) / step) in [0, 255]; a = min, b = step
//   int4  half a byte per value (the even channel in the low nibble), [0, 15]; a = min, b = step
// Values, per token:
//   auto, bf16  as keys
//   fp8   every row's E4M3 codes of x / scale, then per group it touches the group's scale, a
//         power of two: an E8M0 byte (OCP MX's scale), the smallest with max|x| / scale <= 448
//   int8  each row d codes round(x / scale) in [−127, 127], then its bf16 scale max|x| / 127
//   int4  each row d / 2 bytes of codes, then per group of kInt4ValueGroup channels an f16 step
//         and an f16 minimum (KIVI's asymmetric quantisation)
// Steps and scales are rounded up and minimums down, so that no code leaves its range.
inline constexpr int kKeyGroupTokens = 128;
inline constexpr int kKeyRecentTokens = 16;
inline constexpr int kInt4ValueGroup = 128;

#if defined(__CUDACC__)
#define KVWIRE_GROUPS_HD __host__ __device__
#else
#define KVWIRE_GROUPS_HD
#endif

// The groups of a cache head that keeps `kept` prompt tokens: [G·g, min(G·(g + 1), r)) below
// r = max(0, kept − kKeyRecentTokens), then [r, kept), then the appended tokens' groups of G
// from kept (G = kKeyGroupTokens).
struct KvGroups {
  int kept = 0;

  KVWIRE_GROUPS_HD int recent() const {
    return kept > kKeyRecentTokens ? kept - kKeyRecentTokens : 0;
  }
  // Groups below the recent tokens.
  KVWIRE_GROUPS_HD int below() const { return (recent() + kKeyGroupTokens - 1) / kKeyGroupTokens; }
  KVWIRE_GROUPS_HD int prompt_groups() const { return below() + (kept > recent() ? 1 : 0); }
  KVWIRE_GROUPS_HD int Of(int t) const {
    if (t < recent()) return t / kKeyGroupTokens;
    if (t < kept) return below();
    return prompt_groups() + (t - kept) / kKeyGroupTokens;
  }
  KVWIRE_GROUPS_HD int Begin(int g) const {
    if (g < below()) return g * kKeyGroupTokens;
    if (g < prompt_groups()) return recent();
    return kept + (g - prompt_groups()) * kKeyGroupTokens;
  }
  KVWIRE_GROUPS_HD int End(int g) const {
    if (g < below())
      return (g + 1) * kKeyGroupTokens < recent() ? (g + 1) * kKeyGroupTokens : recent();
    if (g < prompt_groups()) return kept;
    return Begin(g) + kKeyGroupTokens;
  }
  // Groups a cache of `capacity` tokens can hold, however many it keeps.
  static KVWIRE_GROUPS_HD int Max(int capacity) { return capacity / kKeyGroupTokens + 3; }
};

// E8M0, OCP MX's scale: the byte e stands for 2^(e − 127) (255, NaN, is never written).
// The smallest power of two s with v / s <= limit, as its byte (v >= 0; 0 for v = 0).
uint8_t E8M0Up(float v, float limit);
inline float E8M0ToFloat(uint8_t e) { return std::ldexp(1.0f, int{e} - 127); }

// Whether `format` can code heads of `head_dim` values (int4 packs pairs: an even head_dim).
absl::Status CheckKvFormat(KvFormat format, int head_dim);
// Whether rows in `format` are codes with parameters (fp8, int8, int4), not plain rows.
inline bool KvCoded(KvFormat format) {
  return format == KvFormat::kFP8 || format == KvFormat::kInt8 || format == KvFormat::kInt4;
}

// Bytes of one key row's codes, of one key group's parameters, and of one value row.
size_t KvKeyCodeBytes(KvFormat format, DType dtype, int head_dim);
size_t KvKeyGroupBytes(KvFormat format, int head_dim);
size_t KvValueRowBytes(KvFormat format, DType dtype, int head_dim);
// Groups that the block of tokens [first, first + n) of a head keeping `kept` touches (0 for
// the raw formats).
int KvBlockGroups(KvFormat format, int kept, int first, int n);
// Bytes of such a block's keys and values.
size_t KvKeyBlockBytes(KvFormat format, DType dtype, int head_dim, int kept, int first, int n);
size_t KvValueBlockBytes(KvFormat format, DType dtype, int head_dim, int kept, int first, int n);

// Encodes tokens [first, first + n) of a head as one key or value block, from `head`, the
// head's `kept` rows of `head_dim` values in `dtype` (a group's parameters need all its rows);
// decodes a block back into n rows in `dtype`.
void EncodeKvKeys(KvFormat format, DType dtype, int head_dim, int kept, int first, int n,
                  const void* head, void* out);
void DecodeKvKeys(KvFormat format, DType dtype, int head_dim, int kept, int first, int n,
                  const void* in, void* out);
void EncodeKvValues(KvFormat format, DType dtype, int head_dim, int kept, int first, int n,
                    const void* head, void* out);
void DecodeKvValues(KvFormat format, DType dtype, int head_dim, int kept, int first, int n,
                    const void* in, void* out);

// One group of a coded format, as a cache keeps it: n rows in `dtype` coded into n key code
// rows (KvKeyCodeBytes each) and the group's parameters (KvKeyGroupBytes), or into n value rows
// (KvValueRowBytes each) and, for fp8, the group's scale byte.
void EncodeKeyGroup(KvFormat format, DType dtype, int head_dim, int n, const void* rows,
                    uint8_t* codes, uint8_t* params);
void EncodeValueGroup(KvFormat format, DType dtype, int head_dim, int n, const void* rows,
                      uint8_t* codes, uint8_t* fp8_scale);
// One row back, in float32: a key from its codes and its group's parameters, a value from its
// row and (fp8) its group's scale.
void DecodeKeyRow(KvFormat format, int head_dim, const uint8_t* codes, const uint8_t* params,
                  float* out);
void DecodeValueRow(KvFormat format, int head_dim, const uint8_t* row, uint8_t fp8_scale,
                    float* out);

// E4M3 (the "fn" variant: no infinities, 0x7f/0xff NaN, largest finite 448), rounded to
// nearest even and saturated at ±448, as OCP FP8 and Hopper's cvt.satfinite do.
inline constexpr float kE4M3Max = 448.0f;
inline uint8_t FloatToE4M3(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7f;  // NaN
  float a;
  std::memcpy(&a, &abs, 4);
  if (a >= kE4M3Max) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal, steps of 2^-9 (8 rounds up to the smallest normal)
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  uint32_t r = abs + 0x7ffffu + ((abs >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
  const int e = static_cast<int>(r >> 23) - 127 + 7;
  const uint32_t m = (r >> 20) & 7u;
  if (e > 15 || (e == 15 && m == 7)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(e << 3) | static_cast<uint8_t>(m);
}

inline float E4M3ToFloat(uint8_t x) {
  const int e = (x >> 3) & 15;
  const int m = x & 7;
  float v;
  if (e == 15 && m == 7) {
    v = NAN;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), -9);
  } else {
    v = std::ldexp(1.0f + m / 8.0f, e - 7);
  }
  return (x & 0x80) ? -v : v;
}

}  // namespace kvwire
