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

// The groups of a cache head that keeps `kept` prompt tokens: [G·g, min(G·(g + 1), r)) below
// r = max(0, kept − kKeyRecentTokens), then [r, kept), then the appended tokens' groups of G
// from kept (G = kKeyGroupTokens).
struct KvGroups {
  int kept = 0;

  KVWIRE_HOST_DEVICE int recent() const {
    return kept > kKeyRecentTokens ? kept - kKeyRecentTokens : 0;
  }
  // Groups below the recent tokens.
  KVWIRE_HOST_DEVICE int below() const {
    return (recent() + kKeyGroupTokens - 1) / kKeyGroupTokens;
  }
  KVWIRE_HOST_DEVICE int prompt_groups() const { return below() + (kept > recent() ? 1 : 0); }
  KVWIRE_HOST_DEVICE int Of(int t) const {
    if (t < recent()) return t / kKeyGroupTokens;
    if (t < kept) return below();
    return prompt_groups() + (t - kept) / kKeyGroupTokens;
  }
  KVWIRE_HOST_DEVICE int Begin(int g) const {
    if (g < below()) return g * kKeyGroupTokens;
    if (g < prompt_groups()) return recent();
    return kept + (g - prompt_groups()) * kKeyGroupTokens;
  }
  KVWIRE_HOST_DEVICE int End(int g) const {
    if (g < below())
      return (g + 1) * kKeyGroupTokens < recent() ? (g + 1) * kKeyGroupTokens : recent();
    if (g < prompt_groups()) return kept;
    return Begin(g) + kKeyGroupTokens;
  }
  // Groups a cache of `capacity` tokens can hold, however many it keeps.
  static KVWIRE_HOST_DEVICE int Max(int capacity) { return capacity / kKeyGroupTokens + 3; }
};

// Whether `format` can code heads of `head_dim` values (int4 packs pairs: an even head_dim).
absl::Status CheckKvFormat(KvFormat format, int head_dim);
// Whether rows in `format` are codes with parameters (fp8, int8, int4), not plain rows.
inline bool KvCoded(KvFormat format) {
  return format == KvFormat::kFP8 || format == KvFormat::kInt8 || format == KvFormat::kInt4;
}

// Bytes of one key row's codes, of one key group's parameters, and of one value row.
size_t KvKeyCodeBytes(KvFormat format, DType dtype, int head_dim);
// The same for a coded format (fp8, int8, int4), where they do not depend on the dtype.
KVWIRE_HOST_DEVICE inline int CodedKeyRowBytes(KvFormat f, int d) {
  return f == KvFormat::kInt4 ? (d + 1) / 2 : d;
}
KVWIRE_HOST_DEVICE inline int CodedValueRowBytes(KvFormat f, int d) {
  if (f != KvFormat::kInt4) return f == KvFormat::kInt8 ? d + 2 : d;  // int8: then a bf16 scale
  const int g = d < kInt4ValueGroup ? d : kInt4ValueGroup;            // then {step, min} per group
  return (d + 1) / 2 + 4 * ((d + g - 1) / g);
}
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

// ------------------------------------------------------------------ scalar coders
// What the coders above do to one value, shared with the CUDA kernels (which code the groups
// decode appends on the device), so that the host and the device code alike, bit for bit.

// E4M3 (the "fn" variant: no infinities, 0x7f/0xff NaN, largest finite 448), rounded to
// nearest even and saturated at ±448, as OCP FP8 and Hopper's cvt.satfinite do.
inline constexpr float kE4M3Max = 448.0f;
KVWIRE_HOST_DEVICE inline uint8_t FloatToE4M3(float f) {
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

KVWIRE_HOST_DEVICE inline float E4M3ToFloat(uint8_t x) {
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

// E8M0, OCP MX's scale: the byte e stands for 2^(e − 127) (255, NaN, is never written).
KVWIRE_HOST_DEVICE inline float E8M0ToFloat(uint8_t e) { return std::ldexp(1.0f, int{e} - 127); }
// The smallest power of two s with v / s <= limit, as its byte (v >= 0; 0 for v = 0).
KVWIRE_HOST_DEVICE inline uint8_t E8M0Up(float v, float limit) {
  if (!(v > 0)) return 0;
  if (!std::isfinite(v / limit)) return 254;
  int k;
  std::frexp(v / limit, &k);  // v / limit = m · 2^k, m in [0.5, 1): 2^k >= v / limit
  if (std::ldexp(1.0f, k - 1) * limit >= v) --k;  // v / limit a power of two
  if (v / std::ldexp(1.0f, k) > limit) ++k;       // the division's rounding
  k += 127;
  return static_cast<uint8_t>(k < 0 ? 0 : (k > 254 ? 254 : k));
}

// The smallest f16 (bf16) at or above v >= 0, so that a range divided by it stays in range.
KVWIRE_HOST_DEVICE inline uint16_t F16Up(float v) {
  uint16_t h = FloatToF16(v);
  if (F16ToFloat(h) < v && (h & 0x7c00u) != 0x7c00u) ++h;
  return h;
}
// The largest f16 at or below v.
KVWIRE_HOST_DEVICE inline uint16_t F16Down(float v) {
  uint16_t h = FloatToF16(v);
  if (F16ToFloat(h) > v)
    h = (h & 0x8000u) ? static_cast<uint16_t>(h + 1)
                      : (h == 0 ? 0x8001u : static_cast<uint16_t>(h - 1));
  return h;
}
KVWIRE_HOST_DEVICE inline uint16_t Bf16Up(float v) {
  uint16_t h = FloatToBf16(v);
  if (Bf16ToFloat(h) < v && (h & 0x7f80u) != 0x7f80u) ++h;
  return h;
}

// A code from a quotient that may be NaN (a cache never holds one, but the wire's input is not
// trusted to be a cache): NaN codes as 0 rather than through an undefined conversion.
KVWIRE_HOST_DEVICE inline float ClampCode(float q, float lo, float hi) {
  return std::isnan(q) ? 0.0f : (q < lo ? lo : (q > hi ? hi : q));
}

// The affine code of values in [lo, hi]: a key channel over its group's tokens (fp8, int8,
// int4), or a group of an int4 value row's channels. {a, b} are the f16 parameters the wire
// carries; a value x codes as round((x − base) / step) (fp8: E4M3 of that quotient) and decodes
// as a + b · code.
struct AffineParams {
  uint16_t a = 0, b = 0;
  float base = 0, step = 0;  // a and b as floats
};
KVWIRE_HOST_DEVICE inline AffineParams AffineFor(KvFormat f, float lo, float hi) {
  // Both parameters f16; the step rounded up, so that the extremes code to the range's ends
  // (E4M3's ±448, the integers' 0 and 255 or 15) and come back within a part in 2^11: a
  // power-of-two scale, which leaves them anywhere in the top binade, loses the retrieval
  // model's positional heads (docs/algorithms.md §10.3). A constant channel, too, codes its
  // distance from its rounded centre or minimum: an offset that the tokens decode appends
  // would not share shifts their scores against the prompt's.
  // -0 made +0: which zero fmin and fmax return for (-0, +0) differs between the host's libm
  // and the GPU's, and the device's codes must be the host's byte for byte.
  lo += 0.0f;
  hi += 0.0f;
  AffineParams p;
  if (f == KvFormat::kFP8) {
    p.a = FloatToF16((hi + lo) / 2);
    p.base = F16ToFloat(p.a);
    p.b = F16Up(std::fmax(hi - p.base, p.base - lo) / kE4M3Max);
  } else {
    p.a = F16Down(lo);  // at or below every value: codes are never negative
    p.base = F16ToFloat(p.a);
    p.b = F16Up((hi - p.base) / (f == KvFormat::kInt8 ? 255.0f : 15.0f));
  }
  p.step = F16ToFloat(p.b);
  return p;
}
// x's code: an E4M3 byte (fp8), a byte in [0, 255] (int8) or a nibble in [0, 15] (int4).
KVWIRE_HOST_DEVICE inline uint8_t AffineCode(KvFormat f, const AffineParams& p, float x) {
  const float r = x - p.base;
  if (f == KvFormat::kFP8) return p.step > 0 ? FloatToE4M3(r / p.step) : 0;
  const float q = p.step > 0 ? std::nearbyint(r / p.step) : 0.0f;
  return static_cast<uint8_t>(ClampCode(q, 0.0f, f == KvFormat::kInt8 ? 255.0f : 15.0f));
}

// Little-endian u16 parameters and int4's nibbles (the even channel in the low one), in rows
// of any alignment.
KVWIRE_HOST_DEVICE inline void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
KVWIRE_HOST_DEVICE inline uint16_t GetU16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
KVWIRE_HOST_DEVICE inline void PutNibble(uint8_t* codes, int j, uint8_t c) {
  codes[j / 2] = (j % 2 == 0) ? static_cast<uint8_t>((codes[j / 2] & 0xf0u) | c)
                              : static_cast<uint8_t>((codes[j / 2] & 0x0fu) | (c << 4));
}
KVWIRE_HOST_DEVICE inline int GetNibble(const uint8_t* codes, int j) {
  return (j % 2 == 0) ? (codes[j / 2] & 0x0f) : (codes[j / 2] >> 4);
}

// Key channel c of a group of n tokens, x(t) its value at token t: its parameters into
// params + 4c, its codes into row(t), the code row of token t (a nibble of it for int4, the
// other nibble left as it is).
template <typename X, typename Row>
KVWIRE_HOST_DEVICE void CodeKeyChannel(KvFormat f, int c, int n, X x, Row row, uint8_t* params) {
  float lo = x(0), hi = lo;
  for (int t = 1; t < n; ++t) {
    lo = std::fmin(lo, x(t));
    hi = std::fmax(hi, x(t));
  }
  const AffineParams p = AffineFor(f, lo, hi);
  PutU16(params + 4 * c, p.a);
  PutU16(params + 4 * c + 2, p.b);
  for (int t = 0; t < n; ++t) {
    const uint8_t code = AffineCode(f, p, x(t));
    if (f == KvFormat::kInt4) {
      PutNibble(row(t), c, code);
    } else {
      row(t)[c] = code;
    }
  }
}

// An int8 or int4 value row of d values x(i), coded into `out` (KvValueRowBytes); fp8 rows
// share their group's scale instead (EncodeValueGroup).
template <typename X>
KVWIRE_HOST_DEVICE void CodeIntValueRow(KvFormat f, int d, X x, uint8_t* out) {
  if (f == KvFormat::kInt8) {
    float amax = 0;
    for (int i = 0; i < d; ++i) amax = std::fmax(amax, std::fabs(x(i)));
    const uint16_t s = Bf16Up(amax / 127.0f);
    const float scale = Bf16ToFloat(s);
    for (int i = 0; i < d; ++i) {
      const float q = scale > 0 ? std::nearbyint(x(i) / scale) : 0.0f;
      out[i] = static_cast<uint8_t>(static_cast<int8_t>(ClampCode(q, -127.0f, 127.0f)));
    }
    PutU16(out + d, s);
    return;
  }
  // int4: groups of kInt4ValueGroup channels, each with a step and a minimum (KIVI's
  // asymmetric quantisation, coded as a key channel is).
  const int g = d < kInt4ValueGroup ? d : kInt4ValueGroup;
  uint8_t* params = out + (d + 1) / 2;
  for (int first = 0, k = 0; first < d; first += g, ++k) {
    const int n = d - first < g ? d - first : g;
    float lo = x(first), hi = lo;
    for (int i = first + 1; i < first + n; ++i) {
      lo = std::fmin(lo, x(i));
      hi = std::fmax(hi, x(i));
    }
    const AffineParams p = AffineFor(KvFormat::kInt4, lo, hi);
    for (int i = first; i < first + n; ++i) PutNibble(out, i, AffineCode(f, p, x(i)));
    PutU16(params + 4 * k, p.b);  // the step, then the minimum
    PutU16(params + 4 * k + 2, p.a);
  }
}

}  // namespace kvwire
