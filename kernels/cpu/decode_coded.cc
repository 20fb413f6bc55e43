// GCC 12 takes the _mm512_undefined_* placeholders inside its AVX-512 intrinsics for
// uninitialised reads once they are inlined here (a false -Wmaybe-uninitialized, or
// -Wuninitialized for the unpacks and shuffles); the pragmas must precede the headers, where
// the warnings are placed.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include "kernels/cpu/decode_coded.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/coded_rows.h"
#include "kernels/simd.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvwire::kernels::cpu {
namespace {

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);  // one instruction, where F16ToFloat is a dozen (exact either way)
#else
  return F16ToFloat(h);
#endif
}

// E4M3ToFloat by bit arithmetic, so that a row's loop vectorises: a normal code's exponent and
// mantissa bits shifted into a float's, the exponent rebased (+120), a subnormal m · 2^-9.
inline float E4M3Bits(uint8_t x) {
  const uint32_t em = x & 0x7fu;
  float v;
  if (em >= 8) {
    const uint32_t bits = (em << 20) + (120u << 23);
    std::memcpy(&v, &bits, 4);
  } else {
    v = static_cast<float>(em) * 0x1p-9f;
  }
  if (em == 0x7fu) v = NAN;
  return (x & 0x80u) ? -v : v;
}

// A row's codes as floats: the key codes (fp8 as E4M3 values, the integers as themselves), or
// a value row dequantised (fp8 before its group's scale).
void KeyCodes(KvFormat f, int d, const uint8_t* row, float* out) {
  switch (f) {
    case KvFormat::kFP8:
      for (int i = 0; i < d; ++i) out[i] = E4M3Bits(row[i]);
      return;
    case KvFormat::kInt8:
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(row[i]);
      return;
    default:
      for (int i = 0; i < d / 2; ++i) {
        out[2 * i] = static_cast<float>(row[i] & 0x0f);
        out[2 * i + 1] = static_cast<float>(row[i] >> 4);
      }
      return;
  }
}

void ValueRow(KvFormat f, int d, const uint8_t* row, float* out) {
  switch (f) {
    case KvFormat::kFP8:
      for (int i = 0; i < d; ++i) out[i] = E4M3Bits(row[i]);
      return;
    case KvFormat::kInt8: {
      uint16_t s;
      std::memcpy(&s, row + d, 2);
      const float scale = Bf16ToFloat(s);
      for (int i = 0; i < d; ++i) out[i] = static_cast<float>(static_cast<int8_t>(row[i])) * scale;
      return;
    }
    default: {
      const int g = std::min(kInt4ValueGroup, d);
      const uint8_t* params = row + d / 2;
      for (int first = 0; first < d; first += g, params += 4) {
        const float step = F16At(params), min = F16At(params + 2);
        for (int i = first / 2; i < std::min(d, first + g) / 2; ++i) {
          out[2 * i] = static_cast<float>(row[i] & 0x0f) * step + min;
          out[2 * i + 1] = static_cast<float>(row[i] >> 4) * step + min;
        }
      }
      return;
    }
  }
}

// A key group's parameters folded into the group's query heads: qb = q ∘ b and qa = q·a, so
// that a key of the group scores qa + qb·codes.
void FoldGroup(const uint8_t* params, const float* q, int group, int d, float* qb, float* qa) {
  for (int g = 0; g < group; ++g) {
    float dot = 0.f;
    for (int i = 0; i < d; ++i) {
      qb[g * d + i] = q[g * d + i] * F16At(params + 4 * i + 2);
      dot += q[g * d + i] * F16At(params + 4 * i);
    }
    qa[g] = dot;
  }
}

// The scores of each query head made its softmax, written to its probabilities if asked for,
// and its output cleared.
void Normalise(const DecodeSequence& seq, int c, int group, int d, const int32_t* idx, int count,
               float* s, float* out) {
  for (int h = 0; h < group; ++h) {
    float* sh = s + int64_t{h} * count;
    const float mx = simd::Max(sh, count);
    const float inv = 1.f / simd::ExpShiftSum(sh, count, mx);
    for (int x = 0; x < count; ++x) sh[x] *= inv;
    std::fill(out + h * d, out + (h + 1) * d, 0.f);
    if (seq.probs) {
      float* probs = seq.probs + (int64_t{c} * group + h) * seq.len;
      std::fill(probs, probs + seq.len, 0.f);
      for (int x = 0; x < count; ++x) probs[idx ? idx[x] : x] = sh[x];
    }
  }
}

// Head c's rows of `bytes` each: in one region (a host cache) by arithmetic, not a call per row.
class HeadRows {
 public:
  HeadRows(const uint8_t* base, const KvLayout& layout, int c, int bytes)
      : base_(base),
        layout_(layout),
        c_(c),
        bytes_(bytes),
        region_(layout.pages == nullptr),
        head_(base + (region_ ? layout.Row(c, 0, bytes) : 0)) {}
  const uint8_t* operator()(int t) const {
    return region_ ? head_ + int64_t{t} * bytes_ : base_ + layout_.Row(c_, t, bytes_);
  }

 private:
  const uint8_t* base_;
  const KvLayout& layout_;
  int c_, bytes_;
  bool region_;
  const uint8_t* head_;
};

// Row x (token tok, in the residual) scored by the group's query heads; the residual is in the
// cache dtype.
void ResidualScores(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                    int x, int tok, int count, float* s) {
  const KvCoding& coding = seq.coding;
  const float* q = seq.q + int64_t{c} * group * d;
  const void* r = static_cast<const uint8_t*>(coding.k_resid) +
                  ResidAt(coding, dtype, d, c, tok - coding.ResidBegin(seq.len));
  for (int g = 0; g < group; ++g)
    s[int64_t{g} * count + x] = simd::Dot(q + g * d, r, dtype, d) * scale;
}

// The residual's rows added to the group's outputs, weighed by their probabilities in s.
void AddResidualValues(const DecodeSequence& seq, int c, int group, int d, DType dtype,
                       const int32_t* idx, int count, const float* s, float* out) {
  const KvCoding& coding = seq.coding;
  const int resid = coding.ResidBegin(seq.len);
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok < resid) continue;
    const void* r =
        static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, tok - resid);
    for (int g = 0; g < group; ++g) simd::Axpy(s[int64_t{g} * count + x], r, dtype, out + g * d, d);
  }
}

#if KVWIRE_AVX2 && defined(__F16C__)
// The hardware prefetcher alone does not run far enough ahead of a stream of short rows with
// work between (as in the dtype kernel): each pass asks for the row kAhead tokens on.
constexpr int kAhead = 16;
inline void Prefetch(const uint8_t* row, int bytes) {
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  __builtin_prefetch(row + bytes - 1, 0, 3);
}

// fp8 codes are widened through f16 (F16C converts eight or sixteen in one instruction), whose
// exponent is biased 8 above E4M3's: each comes as its value times kFP8Unit, which the kernel
// folds into the query and the values' scales (a power of two: the products are unchanged).
constexpr float kFP8Unit = 0x1p-8f;

// int4's 2N codes from channel i come as the even channels' nibbles, then the odd ones' (each
// byte's low and high nibble: widening a byte is then one instruction and splitting it two,
// where channel order took four more): the kernel orders the query's channels so (Int4Order,
// below), and puts the outputs' back.
template <int N>
void ChannelOrder(float* x, int d) {
  float t[2 * N];
  for (int i = 0; i < d; i += 2 * N) {
    for (int j = 0; j < N; ++j) t[2 * j] = x[i + j], t[2 * j + 1] = x[i + N + j];
    std::memcpy(x + i, t, sizeof(t));
  }
}

// 2N codes from `row` at channel i (a multiple of 2N), as two vectors of N floats: E4M3 values
// (fp8, as kFP8Unit says), the integers (int8 keys' unsigned codes, int4's nibbles in
// Int4Order), or int8 values' signed codes, N = 8 (AVX2) or 16 (AVX-512). fp8 does not decode NaN
// codes (low seven bits set) but marks them in `seen`, a byte of it 0xFF: the kernel then gives
// the head to the scalar one, whose E4M3 decoding gives the reference's NaN, rather than every
// vector paying for the check. The kernel below is written once over these two widths.
struct Vec8 {
  using T = __m256;
  using Seen = __m128i;
  static constexpr int N = 8;
  static T Zero() { return _mm256_setzero_ps(); }
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T Set1(float x) { return _mm256_set1_ps(x); }
  static T Fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T Add(T a, T b) { return _mm256_add_ps(a, b); }
  static T Mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static float Sum(T v) { return simd::HorizontalSum(v); }
  static Seen NoneSeen() { return _mm_setzero_si128(); }
  static bool SawNaN(Seen seen) {
    return _mm_movemask_epi8(_mm_cmpeq_epi8(seen, _mm_set1_epi8(-1))) != 0;
  }
  template <KvFormat F, bool kSigned = false>
  static void Codes2(const uint8_t* row, int i, T* lo, T* hi, Seen* seen) {
    if constexpr (F == KvFormat::kInt4) {  // lo: the even channels, hi: the odd (Int4Order)
      const __m256i x =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2)));
      *lo = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0x0f)));
      *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      if constexpr (F == KvFormat::kInt8) {
        const __m128i b_hi = _mm_srli_si128(b, 8);
        *lo = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
        *hi = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(b_hi) : _mm256_cvtepu8_epi32(b_hi));
      } else {
        // E4M3 as f16 bits: the code's low 7 bits at the f16's 7..13, its sign moved from
        // bit 14 to 15 by adding bit 14 to itself.
        __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);
        w = _mm256_add_epi16(w, _mm256_and_si256(w, _mm256_set1_epi16(0x4000)));
        *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
        *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
        *seen = _mm_max_epu8(*seen, _mm_or_si128(b, _mm_set1_epi8(-128)));
      }
    }
  }
  // The even lanes of a then of b, and the odd ones.
  static void EvenOdd(T a, T b, T* even, T* odd) {
    // In each 128-bit lane a's two evens (odds) then b's; then the lanes' halves in order.
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                              _MM_SHUFFLE(3, 1, 2, 0)));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))),
                              _MM_SHUFFLE(3, 1, 2, 0)));
  }
  // Eight channels' key parameters (f16 pairs {a, b}, 4 bytes a channel) as a and b.
  static void Params(const uint8_t* p, T* a, T* b) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i lo = _mm256_and_si256(x, _mm256_set1_epi32(0xffff));
    const __m256i hi = _mm256_srli_epi32(x, 16);
    *a = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1)));
    *b = _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
  }
  // Lane j of the result: the sum of a[j]'s lanes. A transpose that adds as it goes: 21
  // operations for the 8 vectors, where 8 horizontal sums take about 40.
  [[gnu::always_inline]] static T SumEach(const T* a) {
    __m256 b[4], c[2];
    for (int k = 0; k < 4; ++k) {
      b[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                           _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    }
    for (int k = 0; k < 2; ++k) {
      const __m256d x = _mm256_castps_pd(b[2 * k]), y = _mm256_castps_pd(b[2 * k + 1]);
      c[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                           _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                         _mm256_permute2f128_ps(c[0], c[1], 0x31));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct Vec16 {
  using T = __m512;
  using Seen = __m256i;
  static constexpr int N = 16;
  static T Zero() { return _mm512_setzero_ps(); }
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T Set1(float x) { return _mm512_set1_ps(x); }
  static T Fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T Add(T a, T b) { return _mm512_add_ps(a, b); }
  static T Mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static float Sum(T v) { return _mm512_reduce_add_ps(v); }
  static Seen NoneSeen() { return _mm256_setzero_si256(); }
  static bool SawNaN(Seen seen) { return _mm256_cmpeq_epi8_mask(seen, _mm256_set1_epi8(-1)) != 0; }
  template <KvFormat F, bool kSigned = false>
  static void Codes2(const uint8_t* row, int i, T* lo, T* hi, Seen* seen) {
    if constexpr (F == KvFormat::kInt4) {  // as Vec8's
      const __m512i x =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2)));
      *lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(0x0f)));
      *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
    } else if constexpr (F == KvFormat::kInt8) {
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16));
      *lo = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0));
      *hi = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1));
    } else {  // as Vec8's, thirty-two at a time
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
      __m512i w = _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 7);
      w = _mm512_add_epi16(w, _mm512_and_si512(w, _mm512_set1_epi16(0x4000)));
      *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(w));
      *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1));
      *seen = _mm256_max_epu8(*seen, _mm256_or_si256(b, _mm256_set1_epi8(-128)));
    }
  }
  static void EvenOdd(T a, T b, T* even, T* odd) {
    const __m512i evens =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    *even = _mm512_permutex2var_ps(a, evens, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), b);
  }
  static void Params(const uint8_t* p, T* a, T* b) {
    const __m512i x = _mm512_loadu_si512(p);
    *a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
    *b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
  }
  // As Vec8's, over 16 vectors: 45 operations, where 16 horizontal sums take about 130.
  [[gnu::always_inline]] static T SumEach(const T* a) {
    __m512 b[8], c[4], e[2];
    for (int k = 0; k < 8; ++k) {
      b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                           _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    }
    for (int k = 0; k < 4; ++k) {
      const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
      c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // c[k]'s 128-bit lane L: partial sums of a[4k..4k+4) over a's lane L.
    for (int k = 0; k < 2; ++k) {
      e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
};
#endif

// Int4Order: x's channels in the order int4's codes widen, 2N at a time (V::EvenOdd). Once per
// key group and query head: a sparse selection meets a new group every few rows, where a
// channel at a time it cost more than the rows.
template <typename V>
void Int4Order(float* x, int d) {
  for (int i = 0; i < d; i += 2 * V::N) {
    typename V::T even, odd;
    V::EvenOdd(V::Load(x + i), V::Load(x + i + V::N), &even, &odd);
    V::Store(x + i, even);
    V::Store(x + i + V::N, odd);
  }
}

// DecodeHeadCoded for G query heads and a head_dim that is a multiple of kBlock, in vectors V:
// each key row's codes widened once for the G dot products; values in blocks of kBlock channels
// whose G outputs stay in registers while a tile of tokens is added (as the dtype kernel does),
// a row's scale folded into its weight, and int4's per-row minimum summed apart. False where
// it met an fp8 NaN code (see Vec8) or value scale of 2^120 or more: the scalar kernel then does
// the head again.
template <int G, KvFormat F, typename V>
bool DecodeHeadCodedVec(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                        float* s) {
  const KvCoding& coding = seq.coding;
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx = seq.indices ? seq.indices + int64_t{c} * seq.num_indices : nullptr;
  const int resid = coding.ResidBegin(seq.len);
  const KvGroups groups{coding.kept};
  const int kc = static_cast<int>(KvKeyCodeBytes(F, dtype, d));
  const int vc = static_cast<int>(KvValueRowBytes(F, dtype, d));
  const auto* k = static_cast<const uint8_t*>(seq.k);
  const auto* v = static_cast<const uint8_t*>(seq.v);
  const float* q = seq.q + int64_t{c} * G * d;
  float* out = seq.out + int64_t{c} * G * d;
  thread_local std::vector<float> qb, weight, minimum, row_scale, row_min;
  qb.resize(static_cast<size_t>(G) * d);
  float qa[G] = {};
  int current = -1;
  const HeadRows krow(k, seq.layout, c, kc), vrow(v, coding.v_layout, c, vc);
  // Rows in blocks of B = N / G, whose G · B dot products (lane g · B + r: row r, head g) are
  // summed in one SumEach, rather than a horizontal sum each: for a head of 64 channels the sums
  // were as many operations as the multiply-adds. A block is rows of the current key group, all
  // coded; any other row (a group's first, the residual's) is taken alone.
  constexpr int B = V::N / G;
  typename V::Seen seen = V::NoneSeen();
  alignas(64) float lane_qa[V::N];
  const typename V::T vscale = V::Set1(scale);
  // FoldGroup, N channels at a time (once per 128 rows, it was a seventh of the kernel's time
  // done a channel at a time). fp8's codes come as values · kFP8Unit, so b is scaled back.
  auto fold = [&](int gi) {
    const uint8_t* params = coding.k_params + KeyParamsAt(coding, d, c, gi);
    typename V::T dot[G];
    for (int g = 0; g < G; ++g) dot[g] = V::Zero();
    for (int i = 0; i < d; i += V::N) {
      typename V::T a, b;
      V::Params(params + 4 * i, &a, &b);
      if constexpr (F == KvFormat::kFP8) b = V::Mul(b, V::Set1(1.f / kFP8Unit));
      for (int g = 0; g < G; ++g) {
        const typename V::T qv = V::Load(q + g * d + i);
        V::Store(qb.data() + g * d + i, V::Mul(qv, b));
        dot[g] = V::Fmadd(qv, a, dot[g]);
      }
    }
    for (int g = 0; g < G; ++g) qa[g] = V::Sum(dot[g]);
    if constexpr (F == KvFormat::kInt4) {
      for (int g = 0; g < G; ++g) Int4Order<V>(qb.data() + g * d, d);
    }
    for (int j = 0; j < V::N; ++j) lane_qa[j] = qa[j / B];
    current = gi;
  };
  auto block_of_group = [&](int x) {
    if (x + B > count) return false;
    if (!idx) return x + B <= resid && groups.Of(x) == current && groups.Of(x + B - 1) == current;
    for (int r = 0; r < B; ++r) {
      if (idx[x + r] >= resid || groups.Of(idx[x + r]) != current) return false;
    }
    return true;
  };
  // Row x's G dot products added to acc[0], acc[stride], ..., acc[(G - 1) · stride]; the row
  // kAhead on asked for.
  auto add_row = [&](int x, typename V::T* acc, int stride) {
    if (x + kAhead < count) {
      const int next = idx ? idx[x + kAhead] : x + kAhead;
      if (next < resid) Prefetch(krow(next), kc);
    }
    const uint8_t* codes = krow(idx ? idx[x] : x);
    for (int i = 0; i < d; i += 2 * V::N) {
      typename V::T lo, hi;
      V::template Codes2<F>(codes, i, &lo, &hi, &seen);
      for (int g = 0; g < G; ++g) {
        const float* qg = qb.data() + g * d + i;
        acc[g * stride] = V::Fmadd(V::Load(qg), lo, acc[g * stride]);
        acc[g * stride] = V::Fmadd(V::Load(qg + V::N), hi, acc[g * stride]);
      }
    }
  };
  for (int x = 0; x < count;) {
    if (current >= 0 && block_of_group(x)) {
      typename V::T acc[V::N];
      for (int j = 0; j < V::N; ++j) acc[j] = V::Zero();
      for (int r = 0; r < B; ++r) add_row(x + r, acc + r, B);
      alignas(64) float sums[V::N];
      V::Store(sums, V::Mul(V::Add(V::SumEach(acc), V::Load(lane_qa)), vscale));
      for (int g = 0; g < G; ++g) std::memcpy(s + int64_t{g} * count + x, sums + g * B, B * 4);
      x += B;
      continue;
    }
    const int tok = idx ? idx[x] : x;
    if (tok >= resid) {
      ResidualScores(seq, c, G, d, dtype, scale, x, tok, count, s);
      ++x;
      continue;
    }
    const int gi = groups.Of(tok);
    if (gi != current) fold(gi);
    typename V::T acc[G];
    for (int g = 0; g < G; ++g) acc[g] = V::Zero();
    add_row(x, acc, 1);
    for (int g = 0; g < G; ++g) s[int64_t{g} * count + x] = (V::Sum(acc[g]) + qa[g]) * scale;
    ++x;
  }
  Normalise(seq, c, G, d, idx, count, s, out);
  // Values in tiles of tokens that stay in L1 while each block of 32 channels reads them: first
  // each token's weight for head g folded with its row's scale (int8: its bf16 scale; fp8: its
  // group's power of two; int4: per channel group its step, its minimum summed apart), then the
  // blocks. (The weights of all tokens first would stream the rows from memory twice.)
  const int channel_groups = F == KvFormat::kInt4 ? (d + kInt4ValueGroup - 1) / kInt4ValueGroup : 1;
  constexpr bool kSigned = F == KvFormat::kInt8;
  constexpr int kTile = 64;
  constexpr int kVecs = G <= 4 ? 4 : 2, kBlock = kVecs * V::N;
  weight.resize(static_cast<size_t>(G) * kTile * channel_groups);
  row_scale.resize(static_cast<size_t>(kTile) * channel_groups);
  row_min.resize(static_cast<size_t>(kTile) * channel_groups);
  minimum.assign(static_cast<size_t>(G) * channel_groups, 0.f);
  int value_group = -1;
  float group_scale = 1.f;
  bool huge_scale = false;
  for (int x0 = 0; x0 < count; x0 += kTile) {
    const int x1 = std::min(count, x0 + kTile);
    // Each row's scale (and int4's minimum) per channel group, then the weights a vector at a
    // time. The residual's rows weigh nothing here (they are added in the dtype below).
    const int n = x1 - x0;
    for (int x = x0; x < x1; ++x) {
      const int tok = idx ? idx[x] : x;
      if (tok >= resid) {
        for (int cg = 0; cg < channel_groups; ++cg) row_scale[cg * kTile + x - x0] = 0.f;
        if constexpr (F == KvFormat::kInt4) {
          for (int cg = 0; cg < channel_groups; ++cg) row_min[cg * kTile + x - x0] = 0.f;
        }
        continue;
      }
      if (x0 == 0) Prefetch(vrow(tok), vc);  // later tiles' rows: asked for a tile ahead, below
      const uint8_t* r = vrow(tok);
      if constexpr (F == KvFormat::kInt8) {
        uint16_t b;
        std::memcpy(&b, r + d, 2);
        row_scale[x - x0] = Bf16ToFloat(b);
      } else if constexpr (F == KvFormat::kInt4) {
        for (int cg = 0; cg < channel_groups; ++cg) {
          row_scale[cg * kTile + x - x0] = F16At(r + d / 2 + 4 * cg);
          row_min[cg * kTile + x - x0] = F16At(r + d / 2 + 4 * cg + 2);
        }
      } else {
        const int gi = groups.Of(tok);
        if (gi != value_group) {
          const uint8_t e = coding.v_scales[int64_t{c} * coding.max_groups + gi];
          // Scales of 2^120 and up (infinite or huge values) would overflow by kFP8Unit's 2^8:
          // the scalar kernel takes such a head, as it does NaN codes.
          if (e > 127 + 119) huge_scale = true;
          group_scale = E8M0ToFloat(e);
          value_group = gi;
        }
        row_scale[x - x0] = group_scale * (1.f / kFP8Unit);
      }
    }
    for (int g = 0; g < G; ++g) {
      const float* sg = s + int64_t{g} * count + x0;
      for (int cg = 0; cg < channel_groups; ++cg) {
        float* wg = weight.data() + (static_cast<size_t>(g) * channel_groups + cg) * kTile;
        const float* rs = row_scale.data() + cg * kTile;
        int j = 0;
        for (; j + V::N <= n; j += V::N) V::Store(wg + j, V::Mul(V::Load(sg + j), V::Load(rs + j)));
        for (; j < n; ++j) wg[j] = sg[j] * rs[j];
        if constexpr (F == KvFormat::kInt4) {
          const float* rm = row_min.data() + cg * kTile;
          float m = 0.f;
          for (j = 0; j < n; ++j) m += sg[j] * rm[j];
          minimum[g * channel_groups + cg] += m;
        }
      }
    }
    for (int i0 = 0; i0 < d; i0 += kBlock) {
      const int cg = F == KvFormat::kInt4 ? i0 / kInt4ValueGroup : 0;
      typename V::T acc[G][kVecs];
      for (int g = 0; g < G; ++g) {
        for (int u = 0; u < kVecs; ++u) acc[g][u] = V::Load(out + g * d + i0 + V::N * u);
      }
      for (int x = x0; x < x1; ++x) {
        const int tok = idx ? idx[x] : x;
        if (i0 == 0 && x + kTile < count) {
          const int next = idx ? idx[x + kTile] : x + kTile;
          if (next < resid) Prefetch(vrow(next), vc);
        }
        if (tok >= resid) continue;
        const uint8_t* r = vrow(tok);
        typename V::T cv[kVecs];
        for (int u = 0; u < kVecs; u += 2)
          V::template Codes2<F, kSigned>(r, i0 + V::N * u, &cv[u], &cv[u + 1], &seen);
        for (int g = 0; g < G; ++g) {
          const typename V::T w =
              V::Set1(weight[(static_cast<size_t>(g) * channel_groups + cg) * kTile + (x - x0)]);
          for (int u = 0; u < kVecs; ++u) acc[g][u] = V::Fmadd(w, cv[u], acc[g][u]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int u = 0; u < kVecs; ++u) V::Store(out + g * d + i0 + V::N * u, acc[g][u]);
      }
    }
  }
  if constexpr (F == KvFormat::kInt4) {
    for (int g = 0; g < G; ++g) ChannelOrder<V::N>(out + g * d, d);
  }
  for (int g = 0; g < G; ++g) {  // int4's minimums, each over its channel group
    for (int cg = 0; cg < channel_groups; ++cg) {
      const int end = std::min(d, (cg + 1) * kInt4ValueGroup);
      const float m = minimum[g * channel_groups + cg];
      for (int i = cg * kInt4ValueGroup; i < end; ++i) out[g * d + i] += m;
    }
  }
  AddResidualValues(seq, c, G, d, dtype, idx, count, s, out);
  return !V::SawNaN(seen) && !huge_scale;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
// int4 in integer products. In float32 an int4 row costs the bf16 kernel's multiply-adds and
// the widening of its codes besides, which bound it at about twice its memory time. VNNI's
// vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds them four at a time into 16
// int32 lanes, four times a float multiply-add's work in one instruction: the codes are the
// unsigned bytes as they unpack, and what they meet (a key group's q ∘ b for a query head, a
// value tile's weights for a head) is made a fixed-point integer split into kPlanes signed bytes,
// one product each. A key's bytes are summed apart in int32 and put together in float, so that
// q ∘ b takes the whole fixed point (kFixedMax, about 2^23) whatever the head's width: put
// together in int32, as a value tile's are, it would stay within 2^31 / (15 · d), too coarse
// for heads of 256 (docs/algorithms.md §10.7). A tile's weights are at most 2^21 (a lane adds
// 64 tokens). Error: half a unit of the fixed point per term, under 2^-21 of the largest term
// (the float kernel's is 2^-24).
constexpr int kPlanes = 3;
constexpr int kFixedMax = 127 << (8 * (kPlanes - 1));
constexpr int kInt4Chunk = 128;  // channels of a 64-byte load: the value group's width

// The weight of byte p's sums: 256^(kPlanes - 1 - p).
constexpr float PlaneWeight(int p) { return p == kPlanes - 1 ? 1.f : 256.f * PlaneWeight(p + 1); }

// Q as kPlanes signed bytes, most significant first: Q = Σ digit[p] · 256^(kPlanes - 1 - p),
// each digit in [-128, 127] for |Q| ≤ kFixedMax. Packed to bytes by truncation.
inline void Digits(__m512i q, __m128i* digit) {
  for (int p = kPlanes - 1; p > 0; --p) {
    const __m512i up = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
    digit[p] = _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(up, 8)));
    q = up;
  }
  digit[0] = _mm512_cvtepi32_epi8(q);
}

// The multiplier that makes x's largest magnitude `fixed_max`, and its inverse (the unit); false
// where x holds a NaN or an infinity, or is too small to scale (the float kernels take it).
inline bool FixedScale(const float* x, int n, int fixed_max, float* mul, float* unit) {
  __m512 mx = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    mx = _mm512_max_ps(mx, a);
    total = _mm512_add_ps(total, a);  // a NaN or an infinity anywhere makes it one
  }
  if (!std::isfinite(_mm512_reduce_add_ps(total))) return false;
  const float m = _mm512_reduce_max_ps(mx);
  if (m == 0.f) {
    *mul = *unit = 0.f;
    return true;
  }
  *mul = static_cast<float>(fixed_max) / m;
  *unit = m / static_cast<float>(fixed_max);
  return std::isfinite(*mul);
}

// Lanes [0, n) of 16 (all for n >= 16, none for n <= 0).
inline __mmask16 TailMask(int n) {
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// acc + the products of a's unsigned bytes and b's signed ones, four to a lane. In place by
// inline assembly: GCC 12 gave the intrinsic a fresh register and a copy for every product.
[[gnu::always_inline]] inline __m512i Dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Dpbusd with b the four bytes at p in every lane (an operand of the instruction).
[[gnu::always_inline]] inline __m512i DpbusdBroadcast(__m512i acc, __m512i a, const uint8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(a), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// A value tile's four rows interleaved a byte each into every 32-bit lane (what vpdpbusd adds
// together is then one channel of four tokens), then split into nibbles: of chunk k, vector
// 2m + h holds in lane j channel ValueLaneChannel(m, h, j), 16 channels of four tokens.
inline int ValueLaneChannel(int m, int h, int j) { return 32 * (j / 4) + 8 * m + 2 * (j % 4) + h; }

// DecodeHeadCodedVec for int4 in these products, a head_dim of C 128-channel chunks.
template <int G, int C>
bool DecodeHeadInt4Vnni(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                        float* s) {
  const KvCoding& coding = seq.coding;
  // Dense only. A sparse selection touches a few rows of many key groups, and each group's query
  // in fixed point costs more than the float kernel's fold: slower here (docs/benchmarks.md).
  if (seq.indices) return false;
  const int count = seq.len;
  const int resid = coding.ResidBegin(seq.len);
  const KvGroups groups{coding.kept};
  constexpr int chunks = C;
  const int kc = d / 2, vc = static_cast<int>(KvValueRowBytes(KvFormat::kInt4, dtype, d));
  const auto* k = static_cast<const uint8_t*>(seq.k);
  const auto* v = static_cast<const uint8_t*>(seq.v);
  const float* q = seq.q + int64_t{c} * G * d;
  float* out = seq.out + int64_t{c} * G * d;
  const HeadRows krow(k, seq.layout, c, kc), vrow(v, coding.v_layout, c, vc);
  const __m512i nibble = _mm512_set1_epi8(0x0f);

  // Keys. A group's q ∘ b per head in fixed point, as bytes laid out as a row's nibbles unpack
  // (chunk k's low nibbles: its even channels, then its high ones: the odd): key_digits at
  // ((g · kPlanes + p) · chunks + k) · 128 + 64 · h.
  thread_local std::vector<float> qb;
  thread_local std::vector<uint8_t> key_digits;
  qb.resize(static_cast<size_t>(G) * d);
  key_digits.resize(static_cast<size_t>(G) * kPlanes * chunks * 128);
  float qa[G] = {}, key_unit[G] = {};
  constexpr int B = 16 / G;
  alignas(64) float lane_qa[16], lane_unit[16];
  int current = -1;
  auto fold = [&](int gi) {
    const uint8_t* params = coding.k_params + KeyParamsAt(coding, d, c, gi);
    __m512 dot[G];
    for (int g = 0; g < G; ++g) dot[g] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
      __m512 a, b;
      Vec16::Params(params + 4 * i, &a, &b);
      for (int g = 0; g < G; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * d + i);
        _mm512_storeu_ps(qb.data() + g * d + i, _mm512_mul_ps(qv, b));
        dot[g] = _mm512_fmadd_ps(qv, a, dot[g]);
      }
    }
    // Each 32 channels' even ones, then their odd ones, as a row's nibbles unpack.
    const __m512i evens =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int g = 0; g < G; ++g) {
      qa[g] = _mm512_reduce_add_ps(dot[g]);
      float mul;
      if (!FixedScale(qb.data() + g * d, d, kFixedMax, &mul, &key_unit[g])) return false;
      const __m512 vmul = _mm512_set1_ps(mul);
      for (int block = 0; block < d / 32; ++block) {
        const __m512 x0 = _mm512_loadu_ps(qb.data() + g * d + 32 * block);
        const __m512 x1 = _mm512_loadu_ps(qb.data() + g * d + 32 * block + 16);
        for (int h = 0; h < 2; ++h) {
          const __m512 x = _mm512_permutex2var_ps(x0, h ? odds : evens, x1);
          __m128i digit[kPlanes];
          Digits(_mm512_cvtps_epi32(_mm512_mul_ps(x, vmul)), digit);
          for (int p = 0; p < kPlanes; ++p) {
            uint8_t* at = key_digits.data() +
                          ((static_cast<size_t>(g) * kPlanes + p) * chunks + block / 4) * 128 +
                          64 * h + 16 * (block % 4);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(at), digit[p]);
          }
        }
      }
    }
    for (int j = 0; j < 16; ++j) lane_qa[j] = qa[j / B], lane_unit[j] = key_unit[j / B];
    current = gi;
    return true;
  };
  // Row x's G dot products (in units of their head's key_unit, a lane's share of each) to
  // acc[0], acc[stride], ....
  auto row_dots = [&](int x, __m512* acc, int stride) {
    if (x + kAhead < resid) Prefetch(krow(x + kAhead), kc);
    const uint8_t* codes = krow(x);
    __m512i lo[C], hi[C];
    for (int ch = 0; ch < C; ++ch) {
      const __m512i packed = _mm512_loadu_si512(codes + 64 * ch);
      lo[ch] = _mm512_and_si512(packed, nibble);
      hi[ch] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
    // The heads' products interleaved: each head's is a chain of dependent instructions. A
    // lane adds 8 · C channels' products, so here the bytes are put together in int32 by shifts.
    static_assert(int64_t{8} * C * 15 * (kFixedMax + (1 << 16)) <= INT32_MAX);  // (digits round)
    __m512i a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm512_setzero_si512();
    for (int p = 0; p < kPlanes; ++p) {
      if (p > 0) {
        for (int g = 0; g < G; ++g) a[g] = _mm512_slli_epi32(a[g], 8);
      }
      for (int ch = 0; ch < C; ++ch) {
        for (int h = 0; h < 2; ++h) {
          for (int g = 0; g < G; ++g) {
            const uint8_t* w = key_digits.data() +
                               ((static_cast<size_t>(g) * kPlanes + p) * C + ch) * 128 + 64 * h;
            a[g] = Dpbusd(a[g], h ? hi[ch] : lo[ch], _mm512_loadu_si512(w));
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) acc[g * stride] = _mm512_cvtepi32_ps(a[g]);
  };
  const __m512 vscale = _mm512_set1_ps(scale);
  // Whether rows [x, x + n) are all coded rows of the current key group.
  auto run_of_group = [&](int x, int n) {
    return x + n <= resid && groups.Of(x) == current && groups.Of(x + n - 1) == current;
  };
  // Rows x .. x + 15 at once, transposed so that lane r holds row r's 32-bit words one word
  // position at a time: a product then serves 16 rows, its query bytes broadcast, and each
  // lane ends as its row's dot product, with no sum across lanes (which took a fifth of the
  // operations row by row).
  alignas(64) uint8_t transposed[C][16][64];
  auto sixteen_rows = [&](int x) {
    for (int r = 0; r < 16; ++r) {
      if (x + r + 2 * kAhead < resid) Prefetch(krow(x + r + 2 * kAhead), kc);
    }
    for (int ch = 0; ch < C; ++ch) {
      __m512i w[16], t[16];
      for (int r = 0; r < 16; ++r) w[r] = _mm512_loadu_si512(krow(x + r) + 64 * ch);
      for (int r = 0; r < 16; r += 2) {
        t[r] = _mm512_unpacklo_epi32(w[r], w[r + 1]);
        t[r + 1] = _mm512_unpackhi_epi32(w[r], w[r + 1]);
      }
      for (int r = 0; r < 16; r += 4) {  // w[r + k], 128-bit lane L: rows r..r+3 of word 4L + k
        w[r] = _mm512_unpacklo_epi64(t[r], t[r + 2]);
        w[r + 1] = _mm512_unpackhi_epi64(t[r], t[r + 2]);
        w[r + 2] = _mm512_unpacklo_epi64(t[r + 1], t[r + 3]);
        w[r + 3] = _mm512_unpackhi_epi64(t[r + 1], t[r + 3]);
      }
      for (int kk = 0; kk < 4; ++kk) {
        const __m512i a01 = _mm512_shuffle_i32x4(w[kk], w[4 + kk], 0x44);
        const __m512i a23 = _mm512_shuffle_i32x4(w[kk], w[4 + kk], 0xee);
        const __m512i b01 = _mm512_shuffle_i32x4(w[8 + kk], w[12 + kk], 0x44);
        const __m512i b23 = _mm512_shuffle_i32x4(w[8 + kk], w[12 + kk], 0xee);
        _mm512_store_si512(transposed[ch][kk], _mm512_shuffle_i32x4(a01, b01, 0x88));
        _mm512_store_si512(transposed[ch][4 + kk], _mm512_shuffle_i32x4(a01, b01, 0xdd));
        _mm512_store_si512(transposed[ch][8 + kk], _mm512_shuffle_i32x4(a23, b23, 0x88));
        _mm512_store_si512(transposed[ch][12 + kk], _mm512_shuffle_i32x4(a23, b23, 0xdd));
      }
    }
    constexpr int H = G < 4 ? G : 4;  // heads a pass: H · kPlanes accumulators
    for (int g0 = 0; g0 < G; g0 += H) {
      __m512i acc[H][kPlanes];
      for (int g = 0; g < H; ++g) {
        for (int p = 0; p < kPlanes; ++p) acc[g][p] = _mm512_setzero_si512();
      }
      for (int ch = 0; ch < C; ++ch) {
        for (int j = 0; j < 16; ++j) {
          const __m512i word = _mm512_load_si512(transposed[ch][j]);
          const __m512i nibbles[2] = {_mm512_and_si512(word, nibble),
                                      _mm512_and_si512(_mm512_srli_epi16(word, 4), nibble)};
          for (int h = 0; h < 2; ++h) {
            for (int g = 0; g < H; ++g) {
              for (int p = 0; p < kPlanes; ++p) {
                const uint8_t* wq = key_digits.data() +
                                    ((static_cast<size_t>(g0 + g) * kPlanes + p) * C + ch) * 128 +
                                    64 * h + 4 * j;
                acc[g][p] = DpbusdBroadcast(acc[g][p], nibbles[h], wq);
              }
            }
          }
        }
      }
      for (int g = 0; g < H; ++g) {
        __m512 dot = _mm512_cvtepi32_ps(acc[g][0]);
        for (int p = 1; p < kPlanes; ++p)
          dot = _mm512_fmadd_ps(dot, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(acc[g][p]));
        const __m512 score =
            _mm512_fmadd_ps(dot, _mm512_set1_ps(key_unit[g0 + g]), _mm512_set1_ps(qa[g0 + g]));
        _mm512_storeu_ps(s + int64_t{g0 + g} * count + x, _mm512_mul_ps(score, vscale));
      }
    }
  };
  for (int x = 0; x < count;) {
    if (x >= resid) {
      ResidualScores(seq, c, G, d, dtype, scale, x, x, count, s);
      ++x;
      continue;
    }
    const int gi = groups.Of(x);
    if (gi != current && !fold(gi)) return false;
    if (run_of_group(x, 16)) {
      sixteen_rows(x);
      x += 16;
      continue;
    }
    if (run_of_group(x, B)) {
      __m512 sum[16];
      for (int r = 0; r < B; ++r) row_dots(x + r, sum + r, B);
      alignas(64) float sums[16];
      _mm512_store_ps(sums,
                      _mm512_mul_ps(_mm512_fmadd_ps(Vec16::SumEach(sum), _mm512_load_ps(lane_unit),
                                                    _mm512_load_ps(lane_qa)),
                                    vscale));
      for (int g = 0; g < G; ++g) std::memcpy(s + int64_t{g} * count + x, sums + g * B, B * 4);
      x += B;
      continue;
    }
    __m512 acc[G];
    row_dots(x, acc, 1);
    for (int g = 0; g < G; ++g) {
      s[int64_t{g} * count + x] = (_mm512_reduce_add_ps(acc[g]) * key_unit[g] + qa[g]) * scale;
    }
    ++x;
  }
  Normalise(seq, c, G, d, nullptr, count, s, out);

  // Values, in tiles of 64 tokens: each row's weight for head g and chunk k (its probability
  // times the row's step there) in fixed point, a tile's scale per head and chunk; each row's
  // minimum summed apart, in float. A tile's rows are interleaved and split once into
  // `tile_codes` (L1), then every head's products read them.
  constexpr int kTile = 64, kQuads = kTile / 4;
  constexpr int kVecs = G <= 4 ? 4 : 2;  // accumulators: G · kVecs vectors of 16 channels
  // The bytes' sums put together in int32 by shifts (a lane sums kTile tokens' products).
  constexpr int value_max = std::min(kFixedMax, (INT32_MAX - 1) / (15 * kTile) - 1);
  thread_local std::vector<uint8_t> tile_codes, value_digits, zero_row;
  thread_local std::vector<float> acc_out, weight, row_step, row_min, minimum, tile_unit;
  tile_codes.resize(static_cast<size_t>(chunks) * kQuads * 8 * 64);
  value_digits.resize(static_cast<size_t>(G) * chunks * kPlanes * kTile);
  zero_row.assign(static_cast<size_t>(kc), 0);
  acc_out.assign(static_cast<size_t>(G) * d, 0.f);
  weight.resize(kTile);
  row_step.resize(static_cast<size_t>(chunks) * kTile);
  row_min.resize(static_cast<size_t>(chunks) * kTile);
  minimum.assign(static_cast<size_t>(G) * chunks, 0.f);
  tile_unit.resize(static_cast<size_t>(G) * chunks);
  const uint8_t* rows[kTile];
  uint32_t row_params[kTile * C];
  for (int x0 = 0; x0 < count; x0 += kTile) {
    const int n = std::min(count - x0, kTile);
    for (int t = 0; t < kTile; ++t) {
      const int x = x0 + t;
      if (x >= resid) {  // the residual's rows (added in the dtype below) and the padding
        rows[t] = zero_row.data();
        for (int ch = 0; ch < chunks; ++ch) row_params[ch * kTile + t] = 0;
        continue;
      }
      rows[t] = vrow(x);
      if (x0 == 0) Prefetch(rows[t], vc);  // later tiles' rows: asked for a tile ahead, below
      for (int ch = 0; ch < chunks; ++ch)
        std::memcpy(&row_params[ch * kTile + t], rows[t] + kc + 4 * ch, 4);
    }
    for (int j = 0; j < chunks * kTile; j += 16) {  // {step, min} as f16 pairs
      __m512 step, min;
      Vec16::Params(reinterpret_cast<const uint8_t*>(row_params + j), &step, &min);
      _mm512_storeu_ps(row_step.data() + j, step);
      _mm512_storeu_ps(row_min.data() + j, min);
    }
    for (int g = 0; g < G; ++g) {
      const float* sg = s + int64_t{g} * count + x0;
      for (int ch = 0; ch < chunks; ++ch) {
        const float* step = row_step.data() + ch * kTile;
        const float* rm = row_min.data() + ch * kTile;
        __m512 m = _mm512_setzero_ps();
        for (int t = 0; t < kTile; t += 16) {  // (the padding's steps and minimums are 0)
          const __m512 p = _mm512_maskz_loadu_ps(TailMask(n - t), sg + t);
          _mm512_storeu_ps(weight.data() + t, _mm512_mul_ps(p, _mm512_loadu_ps(step + t)));
          m = _mm512_fmadd_ps(p, _mm512_loadu_ps(rm + t), m);
        }
        minimum[g * chunks + ch] += _mm512_reduce_add_ps(m);
        float mul;
        if (!FixedScale(weight.data(), kTile, value_max, &mul, &tile_unit[g * chunks + ch])) {
          return false;
        }
        for (int t = 0; t < kTile; t += 16) {
          __m128i digit[kPlanes];
          Digits(_mm512_cvtps_epi32(
                     _mm512_mul_ps(_mm512_loadu_ps(weight.data() + t), _mm512_set1_ps(mul))),
                 digit);
          for (int p = 0; p < kPlanes; ++p) {
            uint8_t* at = value_digits.data() +
                          ((static_cast<size_t>(g) * chunks + ch) * kPlanes + p) * kTile + t;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(at), digit[p]);
          }
        }
      }
    }
    const int quads = (n + 3) / 4;
    for (int i = 0; i < quads; ++i) {
      for (int ch = 0; ch < chunks; ++ch) {
        __m512i r[4];
        for (int u = 0; u < 4; ++u) r[u] = _mm512_loadu_si512(rows[4 * i + u] + 64 * ch);
        const __m512i a = _mm512_unpacklo_epi8(r[0], r[1]), b = _mm512_unpackhi_epi8(r[0], r[1]);
        const __m512i e = _mm512_unpacklo_epi8(r[2], r[3]), f = _mm512_unpackhi_epi8(r[2], r[3]);
        const __m512i m4[4] = {_mm512_unpacklo_epi16(a, e), _mm512_unpackhi_epi16(a, e),
                               _mm512_unpacklo_epi16(b, f), _mm512_unpackhi_epi16(b, f)};
        uint8_t* at = tile_codes.data() + (static_cast<size_t>(ch) * kQuads + i) * 8 * 64;
        for (int m = 0; m < 4; ++m) {
          _mm512_storeu_si512(at + 64 * (2 * m), _mm512_and_si512(m4[m], nibble));
          _mm512_storeu_si512(at + 64 * (2 * m + 1),
                              _mm512_and_si512(_mm512_srli_epi16(m4[m], 4), nibble));
        }
      }
    }
    for (int ch = 0; ch < chunks; ++ch) {
      for (int v0 = 0; v0 < 8; v0 += kVecs) {
        __m512i acc[G][kVecs];
        for (int g = 0; g < G; ++g) {
          for (int u = 0; u < kVecs; ++u) acc[g][u] = _mm512_setzero_si512();
        }
        for (int p = 0; p < kPlanes; ++p) {
          if (p > 0) {
            for (int g = 0; g < G; ++g) {
              for (int u = 0; u < kVecs; ++u) acc[g][u] = _mm512_slli_epi32(acc[g][u], 8);
            }
          }
          for (int i = 0; i < quads; ++i) {
            // The next tile's rows asked for among the products, one row a quad in each of
            // the first four passes over them: all at once, they held the loop that read them
            // waiting for the memory's queue.
            if (const int pass = (v0 / kVecs) * kPlanes + p, t = 4 * i + pass;
                ch == 0 && pass < 4 && x0 + kTile + t < resid) {
              Prefetch(vrow(x0 + kTile + t), vc);
            }
            const uint8_t* at = tile_codes.data() + (static_cast<size_t>(ch) * kQuads + i) * 8 * 64;
            __m512i cv[kVecs];
            for (int u = 0; u < kVecs; ++u) cv[u] = _mm512_loadu_si512(at + 64 * (v0 + u));
            for (int g = 0; g < G; ++g) {
              int32_t w4;
              std::memcpy(&w4,
                          value_digits.data() +
                              ((static_cast<size_t>(g) * chunks + ch) * kPlanes + p) * kTile +
                              4 * i,
                          4);
              const __m512i w = _mm512_set1_epi32(w4);
              for (int u = 0; u < kVecs; ++u) acc[g][u] = Dpbusd(acc[g][u], cv[u], w);
            }
          }
        }
        for (int g = 0; g < G; ++g) {
          const __m512 unit = _mm512_set1_ps(tile_unit[g * chunks + ch]);
          for (int u = 0; u < kVecs; ++u) {
            float* o = acc_out.data() + g * d + ch * kInt4Chunk + 16 * (v0 + u);
            _mm512_storeu_ps(
                o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g][u]), unit, _mm512_loadu_ps(o)));
          }
        }
      }
    }
  }
  // The outputs put back in channel order, with each chunk's minimums.
  for (int g = 0; g < G; ++g) {
    for (int ch = 0; ch < chunks; ++ch) {
      const float* a = acc_out.data() + g * d + ch * kInt4Chunk;
      float* o = out + g * d + ch * kInt4Chunk;
      const float m = minimum[g * chunks + ch];
      for (int vec = 0; vec < 8; ++vec) {
        for (int j = 0; j < 16; ++j) o[ValueLaneChannel(vec / 2, vec % 2, j)] = a[16 * vec + j] + m;
      }
    }
  }
  AddResidualValues(seq, c, G, d, dtype, nullptr, count, s, out);
  return true;
}
#endif

template <int G, typename V>
bool DecodeHeadCodedAnyFormat(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                              float* s) {
  switch (seq.coding.format) {
    case KvFormat::kFP8:
      return DecodeHeadCodedVec<G, KvFormat::kFP8, V>(seq, c, d, dtype, scale, s);
    case KvFormat::kInt8:
      return DecodeHeadCodedVec<G, KvFormat::kInt8, V>(seq, c, d, dtype, scale, s);
    case KvFormat::kInt4:
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
      // Dense attention over heads of 128 and 256 channels (the kernel declines the rest).
      if constexpr (std::is_same_v<V, Vec16>) {
        if (d == kInt4Chunk && DecodeHeadInt4Vnni<G, 1>(seq, c, d, dtype, scale, s)) return true;
        if (d == 2 * kInt4Chunk && DecodeHeadInt4Vnni<G, 2>(seq, c, d, dtype, scale, s)) {
          return true;
        }
      }
#endif
      return DecodeHeadCodedVec<G, KvFormat::kInt4, V>(seq, c, d, dtype, scale, s);
    default:
      return false;
  }
}

// A value block's width: 4 vectors per query head for groups of up to 4, else 2.
template <typename V>
bool Fits(int group, int d) {
  return d % ((group <= 4 ? 4 : 2) * V::N) == 0;
}

template <typename V>
bool DecodeHeadCodedIn(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                       float* s) {
  if (!Fits<V>(group, d)) return false;
  switch (group) {
    case 1:
      return DecodeHeadCodedAnyFormat<1, V>(seq, c, d, dtype, scale, s);
    case 2:
      return DecodeHeadCodedAnyFormat<2, V>(seq, c, d, dtype, scale, s);
    case 4:
      return DecodeHeadCodedAnyFormat<4, V>(seq, c, d, dtype, scale, s);
    case 8:
      return DecodeHeadCodedAnyFormat<8, V>(seq, c, d, dtype, scale, s);
  }
  return false;
}
#endif

// The vector kernel where it applies: AVX-512 or AVX2, a head_dim of whole value blocks, groups
// of 1, 2, 4 or 8, and no NaN code met.
bool DecodeHeadCodedFast(const DecodeSequence& seq, int c, int group, int d, DType dtype,
                         float scale, float* s) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
  if (Fits<Vec16>(group, d)) return DecodeHeadCodedIn<Vec16>(seq, c, group, d, dtype, scale, s);
#endif
#if KVWIRE_AVX2 && defined(__F16C__)
  return DecodeHeadCodedIn<Vec8>(seq, c, group, d, dtype, scale, s);
#else
  return false;
#endif
}

}  // namespace

// Keys: a key is a + code · b per channel over its group, so a query's score is
// q·a + (q ∘ b)·code: q ∘ b and q·a are formed once per group, and each row costs its codes
// widened and one dot per query head, as a row in the cache dtype does. Values: each row
// dequantised once and added to every head's output.
void DecodeHeadCoded(const DecodeSequence& seq, int c, int group, int d, DType dtype, float scale,
                     float* s) {
  if (DecodeHeadCodedFast(seq, c, group, d, dtype, scale, s)) return;
  const KvCoding& coding = seq.coding;
  const KvFormat f = coding.format;
  const int count = seq.indices ? seq.num_indices : seq.len;
  const int32_t* idx = seq.indices ? seq.indices + int64_t{c} * seq.num_indices : nullptr;
  const int resid = coding.ResidBegin(seq.len);
  const KvGroups groups{coding.kept};
  const int kc = static_cast<int>(KvKeyCodeBytes(f, dtype, d));
  const int vc = static_cast<int>(KvValueRowBytes(f, dtype, d));
  const auto* k = static_cast<const uint8_t*>(seq.k);
  const auto* v = static_cast<const uint8_t*>(seq.v);
  const float* q = seq.q + int64_t{c} * group * d;
  float* out = seq.out + int64_t{c} * group * d;
  thread_local std::vector<float> qb, qa, row;
  qb.resize(static_cast<size_t>(group) * d);
  qa.resize(group);
  row.resize(d);
  int current = -1;
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok >= resid) {
      ToFloat(
          dtype,
          static_cast<const uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, tok - resid),
          row.data(), d);
      for (int g = 0; g < group; ++g) {
        s[int64_t{g} * count + x] = simd::Dot(q + g * d, row.data(), DType::kF32, d) * scale;
      }
      continue;
    }
    const int gi = groups.Of(tok);
    if (gi != current) {
      FoldGroup(coding.k_params + KeyParamsAt(coding, d, c, gi), q, group, d, qb.data(), qa.data());
      current = gi;
    }
    KeyCodes(f, d, k + seq.layout.Row(c, tok, kc), row.data());
    for (int g = 0; g < group; ++g) {
      s[int64_t{g} * count + x] =
          (simd::Dot(qb.data() + g * d, row.data(), DType::kF32, d) + qa[g]) * scale;
    }
  }
  Normalise(seq, c, group, d, idx, count, s, out);
  int value_group = -1;
  float group_scale = 1.f;
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    float row_scale = 1.f;
    if (tok >= resid) {
      ToFloat(
          dtype,
          static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, tok - resid),
          row.data(), d);
    } else {
      ValueRow(f, d, v + coding.v_layout.Row(c, tok, vc), row.data());
      if (f == KvFormat::kFP8) {
        const int gi = groups.Of(tok);
        if (gi != value_group) {
          group_scale = E8M0ToFloat(coding.v_scales[int64_t{c} * coding.max_groups + gi]);
          value_group = gi;
        }
        row_scale = group_scale;
      }
    }
    for (int g = 0; g < group; ++g) {
      simd::Axpy(s[int64_t{g} * count + x] * row_scale, row.data(), DType::kF32, out + g * d, d);
    }
  }
}

}  // namespace kvwire::kernels::cpu
