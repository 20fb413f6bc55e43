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
#include <cmath>
#include <cstring>
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
// where channel order took four more): the kernel orders the query's channels so, and puts the
// outputs' back.
template <int N>
void Int4Order(float* x, int d) {
  float t[2 * N];
  for (int i = 0; i < d; i += 2 * N) {
    for (int j = 0; j < N; ++j) t[j] = x[i + 2 * j], t[N + j] = x[i + 2 * j + 1];
    std::memcpy(x + i, t, sizeof(t));
  }
}
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
  // A row's address: in one region (a host cache) by arithmetic here, not a call per row.
  const bool k_region = seq.layout.pages == nullptr, v_region = coding.v_layout.pages == nullptr;
  const uint8_t* k_head = k + (k_region ? seq.layout.Row(c, 0, kc) : 0);
  const uint8_t* v_head = v + (v_region ? coding.v_layout.Row(c, 0, vc) : 0);
  auto krow = [&](int t) {
    return k_region ? k_head + int64_t{t} * kc : k + seq.layout.Row(c, t, kc);
  };
  auto vrow = [&](int t) {
    return v_region ? v_head + int64_t{t} * vc : v + coding.v_layout.Row(c, t, vc);
  };
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
      for (int g = 0; g < G; ++g) Int4Order<V::N>(qb.data() + g * d, d);
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
      const void* r =
          static_cast<const uint8_t*>(coding.k_resid) + ResidAt(coding, dtype, d, c, tok - resid);
      for (int g = 0; g < G; ++g)
        s[int64_t{g} * count + x] = simd::Dot(q + g * d, r, dtype, d) * scale;
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
  // The residual's rows, in the dtype.
  for (int x = 0; x < count; ++x) {
    const int tok = idx ? idx[x] : x;
    if (tok < resid) continue;
    const void* r =
        static_cast<const uint8_t*>(coding.v_resid) + ResidAt(coding, dtype, d, c, tok - resid);
    for (int g = 0; g < G; ++g) simd::Axpy(s[int64_t{g} * count + x], r, dtype, out + g * d, d);
  }
  return !V::SawNaN(seen) && !huge_scale;
}

template <int G, typename V>
bool DecodeHeadCodedAnyFormat(const DecodeSequence& seq, int c, int d, DType dtype, float scale,
                              float* s) {
  switch (seq.coding.format) {
    case KvFormat::kFP8:
      return DecodeHeadCodedVec<G, KvFormat::kFP8, V>(seq, c, d, dtype, scale, s);
    case KvFormat::kInt8:
      return DecodeHeadCodedVec<G, KvFormat::kInt8, V>(seq, c, d, dtype, scale, s);
    case KvFormat::kInt4:
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
