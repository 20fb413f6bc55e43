// The wire codec: chunking round-trips any layer, exactly in the cache's dtype and as each
// KV format's coding defines in the others; positions code compactly; every malformed
// stream is rejected with an error that says what was wrong; and a fuzz loop of random
// mutations never crashes the receiver nor lets a modified payload through.
#include "common/wire/kv_wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "common/base/shared_region.h"
#include "common/model/kv_pool.h"
#include "common/wire/kv_links.h"

namespace kvwire {
namespace {

constexpr int kPrompt = 100;

CompressedLayer RandomLayer(int layer, int heads, int count, int d, DType dtype,
                            std::mt19937& rng) {
  CompressedLayer l;
  l.layer = layer;
  l.n_heads = heads;
  l.head_dim = d;
  l.count = count;
  l.dtype = dtype;
  for (int h = 0; h < heads; ++h) {
    std::vector<int32_t> pos(kPrompt);
    for (int i = 0; i < kPrompt; ++i) pos[i] = i;
    std::shuffle(pos.begin(), pos.end(), rng);
    pos.resize(count);
    std::sort(pos.begin(), pos.end());
    l.positions.insert(l.positions.end(), pos.begin(), pos.end());
  }
  // Values as a cache holds them (the formats quantise numbers, not bit patterns).
  std::normal_distribution<float> n(0, 2);
  std::vector<float> x(static_cast<size_t>(heads) * count * d);
  l.k.resize(x.size() * DTypeSize(dtype));
  l.v.resize(l.k.size());
  for (std::vector<uint8_t>* out : {&l.k, &l.v}) {
    for (float& f : x) f = n(rng);
    FromFloat(dtype, x.data(), out->data(), x.size());
  }
  return l;
}

struct Stream {
  WireHeader header;
  std::vector<WireChunk> chunks;
  WireTrailer trailer;
  std::vector<CompressedLayer> layers;
};

Stream MakeStream(int layers, int heads, int d, std::vector<int> kept, size_t max_bytes,
                  DType dtype, uint32_t seed, KvFormat format = KvFormat::kAuto) {
  std::mt19937 rng(seed);
  Stream s;
  s.header.model_fingerprint = "model-x";
  s.header.num_layers = layers;
  s.header.num_cache_heads = heads;
  s.header.head_dim = d;
  s.header.dtype = dtype;
  s.header.kv_format = format;
  s.header.prompt_len = kPrompt;
  s.header.kept_per_layer = kept;
  for (int l = 0; l < layers; ++l) {
    s.layers.push_back(RandomLayer(l, heads, kept[l], d, dtype, rng));
    for (auto& c : ChunkLayer(s.layers.back(), format, max_bytes)) {
      s.trailer.kv_payload_bytes += static_cast<int64_t>(c.payload_bytes());
      s.chunks.push_back(std::move(c));
    }
  }
  s.trailer.chunks = static_cast<int>(s.chunks.size());
  s.trailer.first_token = 7;
  return s;
}

std::unique_ptr<KvCache> MakeCache(const Stream& s, int extra = 4) {
  KvCacheShape shape;
  shape.n_heads = s.header.num_cache_heads;
  shape.head_dim = s.header.head_dim;
  shape.dtype = s.header.dtype;
  for (int k : s.header.kept_per_layer) shape.capacity.push_back(k + extra);
  return *KvCache::Create(shape, HeapKvAllocator());
}

WireExpectation Expect(const Stream& s) {
  WireExpectation e;
  e.model_fingerprint = "model-x";
  e.num_layers = s.header.num_layers;
  e.num_cache_heads = s.header.num_cache_heads;
  e.head_dim = s.header.head_dim;
  e.dtype = s.header.dtype;
  e.kv_format = s.header.kv_format;
  e.prompt_len = kPrompt;
  e.kept_per_layer = s.header.kept_per_layer;
  return e;
}

absl::Status Feed(const Stream& s, KvCache* cache, KvAssembler* a = nullptr) {
  KvAssembler own(Expect(s), cache);
  if (a == nullptr) a = &own;
  if (absl::Status st = a->OnHeader(s.header); !st.ok()) return st;
  for (const WireChunk& c : s.chunks) {
    if (absl::Status st = a->OnChunk(c); !st.ok()) return st;
  }
  return a->OnTrailer(s.trailer, 512);
}

// What an accepted stream must have stored: the positions and rows of the chunks it accepted,
// the rows decoded from each chunk's coding into the cache's dtype.
void ExpectCacheHoldsChunks(const std::vector<WireChunk>& chunks, KvFormat format,
                            const std::vector<int>& kept, const KvCache& cache);

// The cache holds what the layers held: the same positions, and rows exactly (auto) or as
// the stream's chunks code them.
void ExpectCacheEquals(const Stream& s, const KvCache& cache) {
  for (const CompressedLayer& l : s.layers) {
    const LayerCache& lc = cache.layer(l.layer);
    ASSERT_EQ(lc.len, l.count);
    const size_t row = lc.row_bytes();
    for (int h = 0; h < l.n_heads; ++h) {
      for (int t = 0; t < l.count; ++t) {
        const size_t i = static_cast<size_t>(h) * l.count + t;
        ASSERT_EQ(lc.position(h, t), l.positions[i]);
        if (s.header.kv_format == KvFormat::kAuto) {
          ASSERT_EQ(std::memcmp(lc.k_row(h, t), &l.k[i * row], row), 0);
          ASSERT_EQ(std::memcmp(lc.v_row(h, t), &l.v[i * row], row), 0);
        }
      }
    }
  }
  ExpectCacheHoldsChunks(s.chunks, s.header.kv_format, s.header.kept_per_layer, cache);
}

TEST(KvWire, Crc32cKnownAnswer) {
  // RFC 3720 B.4: CRC-32C of "123456789" is 0xE3069283; of 32 zero bytes 0x8A9136AA.
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  // Incremental equals one shot.
  EXPECT_EQ(Crc32c("6789", 4, Crc32c("12345", 5)), 0xE3069283u);
}

TEST(KvWire, RoundTripsOverChunkSizes) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (size_t max_bytes : {size_t{1} << 20, size_t{4096}, size_t{300}, size_t{1}}) {
      SCOPED_TRACE(std::to_string(max_bytes));
      const Stream s = MakeStream(3, 4, 16, {64, 1, 100}, max_bytes, dtype, 11);
      for (const WireChunk& c : s.chunks) {
        if (c.token_count > 1) {
          EXPECT_LE(c.payload_bytes(), max_bytes);
        }
      }
      auto cache = MakeCache(s);
      KvAssembler a(Expect(s), cache.get());
      ASSERT_TRUE(Feed(s, cache.get(), &a).ok()) << Feed(s, MakeCache(s).get());
      EXPECT_TRUE(a.complete());
      EXPECT_EQ(a.chunks(), static_cast<int>(s.chunks.size()));
      ExpectCacheEquals(s, *cache);
    }
  }
  for (KvFormat format : kAllKvFormats) {
    for (size_t max_bytes : {size_t{1} << 20, size_t{300}}) {
      SCOPED_TRACE(absl::StrCat(KvFormatName(format), " ", max_bytes));
      const Stream s = MakeStream(2, 3, 16, {64, 7}, max_bytes, DType::kBF16, 12, format);
      for (const WireChunk& c : s.chunks) {
        if (c.token_count > 1) {
          EXPECT_LE(c.payload_bytes(), max_bytes);
        }
      }
      auto cache = MakeCache(s);
      ASSERT_TRUE(Feed(s, cache.get()).ok()) << Feed(s, MakeCache(s).get());
      ExpectCacheEquals(s, *cache);
    }
  }
  // 1 MiB chunks pack whole heads together; tiny ones split heads by tokens.
  EXPECT_EQ(MakeStream(1, 4, 16, {64}, 1 << 20, DType::kF32, 1).chunks.size(), 1u);
  EXPECT_GT(MakeStream(1, 4, 16, {64}, 300, DType::kF32, 1).chunks.size(), 4u);
}

// A chunk's positions decoded, and coded anew (checksum included).
std::vector<int32_t> Positions(const WireChunk& c, int prompt_len) {
  std::vector<int32_t> pos(static_cast<size_t>(c.head_count) * c.token_count);
  size_t offset = 0;
  for (int h = 0; h < c.head_count; ++h) {
    EXPECT_TRUE(DecodePositions(c.positions, &offset, c.token_count, prompt_len,
                                &pos[static_cast<size_t>(h) * c.token_count])
                    .ok());
  }
  return pos;
}
void SetPositions(WireChunk* c, const std::vector<int32_t>& pos) {
  c->positions.clear();
  for (int h = 0; h < c->head_count; ++h) {
    EncodePositions(&pos[static_cast<size_t>(h) * c->token_count], c->token_count, &c->positions);
  }
  c->crc32c = ChunkChecksum(*c);
}

TEST(KvWire, PositionsCodeAsTheSmallerOfDeltasAndABitmap) {
  std::mt19937 rng(3);
  const int prompt = 5000;
  for (int n : {1, 2, 17, 128, 1000, 4999, 5000}) {
    std::vector<int32_t> all(prompt);
    for (int i = 0; i < prompt; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int32_t> pos(all.begin(), all.begin() + n);
    std::sort(pos.begin(), pos.end());
    std::string coded;
    EncodePositions(pos.data(), n, &coded);
    std::vector<int32_t> back(n);
    size_t offset = 0;
    ASSERT_TRUE(DecodePositions(coded, &offset, n, prompt, back.data()).ok()) << n;
    EXPECT_EQ(offset, coded.size());
    EXPECT_EQ(back, pos);
    const size_t bitmap = 1 + 2 + 2 + (pos.back() - pos.front() + 1 + 7) / 8;
    EXPECT_LE(coded.size(), bitmap + 1) << n;  // never worse than a bitmap (varints of <= 2 bytes)
    if (n >= 1000) {
      EXPECT_EQ(coded[0], 1) << "a dense head codes as a bitmap";
    }
    if (n <= 17) {
      EXPECT_EQ(coded[0], 0) << "a sparse head codes as deltas";
    }
  }
  // Every position of a prompt: about one bit each.
  std::vector<int32_t> every(2048);
  for (int i = 0; i < 2048; ++i) every[i] = i;
  std::string coded;
  EncodePositions(every.data(), 2048, &coded);
  EXPECT_LE(coded.size(), 2048u / 8 + 5);
  // A bitmap whose bits disagree with the count is refused.
  std::vector<int32_t> out(3);
  size_t offset = 0;
  EXPECT_FALSE(DecodePositions(coded, &offset, 3, 2048, out.data()).ok());
}

struct Mutation {
  std::string name;
  std::function<void(Stream&)> edit;
  absl::StatusCode code;
  std::string expect;
};

TEST(KvWire, RejectsMalformedStreams) {
  const std::vector<Mutation> cases = {
      {"version 1 (a peer from before KV formats)", [](Stream& s) { s.header.format_version = 1; },
       absl::StatusCode::kInvalidArgument, "format version 1; this node speaks version 3"},
      {"version 2 (groups of a block, not of the head)",
       [](Stream& s) { s.header.format_version = 2; }, absl::StatusCode::kInvalidArgument,
       "format version 2; this node speaks version 3"},
      {"kv format", [](Stream& s) { s.header.kv_format = KvFormat::kInt4; },
       absl::StatusCode::kInvalidArgument, "coded in int4; the request asked for auto"},
      {"fingerprint", [](Stream& s) { s.header.model_fingerprint = "other"; },
       absl::StatusCode::kFailedPrecondition, "model 'other'"},
      {"heads", [](Stream& s) { s.header.num_cache_heads = 8; }, absl::StatusCode::kInvalidArgument,
       "expected 3 x 4"},
      {"dtype", [](Stream& s) { s.header.dtype = DType::kF16; }, absl::StatusCode::kInvalidArgument,
       "f16"},
      {"prompt", [](Stream& s) { s.header.prompt_len = 99; }, absl::StatusCode::kInvalidArgument,
       "the request had 100"},
      {"kept", [](Stream& s) { s.header.kept_per_layer[1] = 3; },
       absl::StatusCode::kInvalidArgument, "compression keeps"},
      {"kept count", [](Stream& s) { s.header.kept_per_layer.pop_back(); },
       absl::StatusCode::kInvalidArgument, "kept_per_layer has 2 entries"},
      {"payload flip", [](Stream& s) { s.chunks[1].k[5] ^= 1; }, absl::StatusCode::kDataLoss,
       "CRC-32C mismatch"},
      {"position flip", [](Stream& s) { s.chunks[0].positions[0] ^= 1; },
       absl::StatusCode::kDataLoss, "CRC-32C mismatch"},
      {"checksum", [](Stream& s) { s.chunks[2].crc32c ^= 0x100; }, absl::StatusCode::kDataLoss,
       "CRC-32C"},
      {"missing chunk", [](Stream& s) { s.chunks.erase(s.chunks.begin() + 1); },
       absl::StatusCode::kInvalidArgument, "out of order"},
      {"duplicate chunk", [](Stream& s) { s.chunks.insert(s.chunks.begin() + 1, s.chunks[1]); },
       absl::StatusCode::kInvalidArgument, "out of order"},
      {"swapped chunks", [](Stream& s) { std::swap(s.chunks[0], s.chunks[1]); },
       absl::StatusCode::kInvalidArgument, "out of order"},
      {"truncated k",
       [](Stream& s) {
         s.chunks[0].k.pop_back();
         s.chunks[0].crc32c = ChunkChecksum(s.chunks[0]);
       },
       absl::StatusCode::kInvalidArgument, "K/V of"},
      {"positions cut off",
       [](Stream& s) {
         s.chunks[0].positions.pop_back();
         s.chunks[0].crc32c = ChunkChecksum(s.chunks[0]);
       },
       absl::StatusCode::kInvalidArgument, "cut off"},
      {"positions with bytes to spare",
       [](Stream& s) {
         s.chunks[0].positions.push_back(0);
         s.chunks[0].crc32c = ChunkChecksum(s.chunks[0]);
       },
       absl::StatusCode::kInvalidArgument, "left after every head's"},
      {"unknown positions coding",
       [](Stream& s) {
         s.chunks[0].positions[0] = 7;
         s.chunks[0].crc32c = ChunkChecksum(s.chunks[0]);
       },
       absl::StatusCode::kInvalidArgument, "unknown coding 7"},
      {"position beyond prompt",
       [](Stream& s) {
         WireChunk& c = s.chunks[0];
         std::vector<int32_t> pos = Positions(c, kPrompt);
         pos.back() = 1000;
         SetPositions(&c, pos);
       },
       absl::StatusCode::kInvalidArgument, "outside the prompt of 100"},
      {"positions not following the previous chunk's",
       [](Stream& s) {
         WireChunk& c = s.chunks[1];  // head 0's second chunk
         ASSERT_GT(c.token_begin, 0);
         std::vector<int32_t> pos = Positions(c, kPrompt);
         pos[0] = 0;
         SetPositions(&c, pos);
       },
       absl::StatusCode::kInvalidArgument, "does not follow the previous chunk's"},
      {"rectangle",
       [](Stream& s) {
         s.chunks[0].head_count = 99;
         s.chunks[0].crc32c = ChunkChecksum(s.chunks[0]);
       },
       absl::StatusCode::kInvalidArgument, "outside the layer"},
      {"trailer counts", [](Stream& s) { s.trailer.chunks += 1; },
       absl::StatusCode::kInvalidArgument, "trailer counts"},
      {"trailer token", [](Stream& s) { s.trailer.first_token = 512; },
       absl::StatusCode::kInvalidArgument, "outside the vocabulary"},
      {"early trailer", [](Stream& s) { s.chunks.pop_back(); }, absl::StatusCode::kInvalidArgument,
       "incomplete"},
      {"overflowing rectangle",
       [](Stream& s) {  // token_begin + count overflows an int
         ASSERT_GT(s.chunks[1].token_begin, 0);
         s.chunks[1].token_count = 0x7fffffff;
         s.chunks[1].crc32c = ChunkChecksum(s.chunks[1]);
       },
       absl::StatusCode::kInvalidArgument, "outside the layer"},
  };
  for (const Mutation& m : cases) {
    Stream s = MakeStream(3, 4, 8, {40, 30, 20}, 700, DType::kF32, 5);
    ASSERT_GE(s.chunks.size(), 4u);
    m.edit(s);
    auto cache = MakeCache(MakeStream(3, 4, 8, {40, 30, 20}, 700, DType::kF32, 5));
    // Expectations come from the unmodified stream (what the decode node asked for).
    const Stream original = MakeStream(3, 4, 8, {40, 30, 20}, 700, DType::kF32, 5);
    KvAssembler a(Expect(original), cache.get());
    absl::Status st = a.OnHeader(s.header);
    for (size_t i = 0; st.ok() && i < s.chunks.size(); ++i) st = a.OnChunk(s.chunks[i]);
    if (st.ok()) st = a.OnTrailer(s.trailer, 512);
    EXPECT_EQ(st.code(), m.code) << m.name << ": " << st;
    EXPECT_NE(std::string(st.message()).find(m.expect), std::string::npos)
        << m.name << ": '" << m.expect << "' not in: " << st.message();
    EXPECT_FALSE(a.complete()) << m.name;
    // After a failure the stream stays failed.
    if (!st.ok()) {
      EXPECT_FALSE(a.OnChunk(original.chunks[0]).ok()) << m.name;
    }
  }
}

TEST(KvWire, ASecondTrailerFails) {
  const Stream s = MakeStream(3, 4, 8, {40, 30, 20}, 700, DType::kF32, 5);
  auto cache = MakeCache(s);
  KvAssembler a(Expect(s), cache.get());
  ASSERT_TRUE(Feed(s, cache.get(), &a).ok());
  ASSERT_TRUE(a.complete());
  const absl::Status st = a.OnTrailer(s.trailer, 512);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("a second trailer"), std::string::npos) << st;
}

// What an accepted stream must have stored: exactly the rows of the chunks it accepted.
void ExpectCacheHoldsChunks(const std::vector<WireChunk>& chunks, KvFormat format,
                            const std::vector<int>& kept, const KvCache& cache) {
  for (const WireChunk& c : chunks) {
    const LayerCache& lc = cache.layer(c.layer);
    const size_t row = lc.row_bytes(), n = c.token_count;
    const int kl = kept[c.layer];
    const size_t k_block =
        KvKeyBlockBytes(format, lc.dtype, lc.head_dim, kl, c.token_begin, c.token_count);
    const size_t v_block =
        KvValueBlockBytes(format, lc.dtype, lc.head_dim, kl, c.token_begin, c.token_count);
    std::vector<uint8_t> k(row * n), v(row * n);
    const std::vector<int32_t> positions = Positions(c, kPrompt);
    for (int h = 0; h < c.head_count; ++h) {
      DecodeKvKeys(format, lc.dtype, lc.head_dim, kl, c.token_begin, c.token_count,
                   &c.k[h * k_block], k.data());
      DecodeKvValues(format, lc.dtype, lc.head_dim, kl, c.token_begin, c.token_count,
                     &c.v[h * v_block], v.data());
      for (size_t t = 0; t < n; ++t) {
        const int head = c.head_begin + h, token = c.token_begin + static_cast<int>(t);
        ASSERT_EQ(lc.position(head, token), positions[h * n + t]);
        ASSERT_EQ(std::memcmp(lc.k_row(head, token), &k[t * row], row), 0);
        ASSERT_EQ(std::memcmp(lc.v_row(head, token), &v[t * row], row), 0);
      }
    }
  }
}

// Random mutations of valid streams: the receiver must return (never crash or read out
// of bounds); a changed payload without a matching checksum must be rejected; and an
// accepted stream must have stored exactly the chunks it accepted. (A mutation whose
// checksum was recomputed is, to the receiver, a valid stream: CRC-32C guards against
// corruption in transit, and TLS against tampering.)
TEST(KvWire, FuzzedStreamsNeverCorruptTheCache) {
  std::mt19937 rng(2024);
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const int layers = 1 + static_cast<int>(rng() % 3), heads = 1 + static_cast<int>(rng() % 4);
    const int d = 2 * (1 + static_cast<int>(rng() % 8));
    const KvFormat format = kAllKvFormats[rng() % 5];
    std::vector<int> kept;
    for (int l = 0; l < layers; ++l) kept.push_back(1 + static_cast<int>(rng() % kPrompt));
    const size_t max_bytes = 1 + rng() % 2000;
    const Stream original = MakeStream(layers, heads, d, kept, max_bytes, DType::kBF16,
                                       static_cast<uint32_t>(rng()), format);
    Stream s = original;
    const int n_mut = 1 + static_cast<int>(rng() % 3);
    for (int m = 0; m < n_mut && !s.chunks.empty(); ++m) {
      WireChunk& c = s.chunks[rng() % s.chunks.size()];
      switch (rng() % 10) {
        case 0:
          c.layer += static_cast<int>(rng() % 3) - 1;
          break;
        case 1:
          c.head_begin = static_cast<int>(rng());
          break;
        case 2:
          c.token_count = static_cast<int>(rng() % 200) - 50;
          break;
        case 3:
          if (!c.k.empty()) c.k[rng() % c.k.size()] ^= static_cast<char>(1 + rng() % 255);
          break;
        case 4:
          c.positions.resize(rng() % (c.positions.size() + 8));
          break;
        case 5:
          c.v.append(static_cast<size_t>(rng() % 9), 'x');
          break;
        case 6:  // whole chunks dropped or repeated: `c` may no longer be valid
          s.chunks.erase(s.chunks.begin() + static_cast<long>(rng() % s.chunks.size()));
          continue;
        case 7:
          s.chunks.push_back(s.chunks[rng() % s.chunks.size()]);
          continue;
        case 8:
          c.crc32c = static_cast<uint32_t>(rng());
          break;
        default:
          s.header.kept_per_layer[rng() % layers] += static_cast<int>(rng() % 5) - 2;
          break;
      }
      if (rng() % 2) c.crc32c = ChunkChecksum(c);  // half the time the checksum is made to match
    }
    auto cache = MakeCache(original);
    KvAssembler a(Expect(original), cache.get());
    absl::Status st = a.OnHeader(s.header);
    for (size_t i = 0; st.ok() && i < s.chunks.size(); ++i) st = a.OnChunk(s.chunks[i]);
    if (st.ok()) st = a.OnTrailer(original.trailer, 512);
    if (st.ok()) {
      ++accepted;
      for (const WireChunk& c : s.chunks) {
        EXPECT_EQ(c.crc32c, ChunkChecksum(c)) << "a chunk with a stale checksum was accepted";
      }
      ExpectCacheHoldsChunks(s.chunks, format, s.header.kept_per_layer, *cache);
    } else {
      ++rejected;
      EXPECT_FALSE(st.message().empty());
    }
  }
  EXPECT_GT(rejected, 2500);
  RecordProperty("accepted", accepted);
}

// ------------------------------------------------------------------ placed chunks (shm)

// A cache in a shared region as a decode node makes one, and the same region mapped again and
// laid out by the same shape, as the prefill node that writes into it does.
struct SharedPair {
  std::unique_ptr<SharedRegion> owner, peer;
  std::unique_ptr<KvCache> decode, prefill;
};
class RegionAllocator final : public KvAllocator {
 public:
  explicit RegionAllocator(SharedRegion* r) : r_(r) {}
  absl::StatusOr<KvMemoryPtr> Allocate(size_t bytes) override {
    struct Memory final : KvMemory {
      SharedRegion* r;
      uint8_t* data() override { return r->data(); }
      size_t size() const override { return r->size(); }
    };
    EXPECT_EQ(bytes, r_->size());
    auto m = std::make_unique<Memory>();
    m->r = r_;
    return KvMemoryPtr(std::move(m));
  }

 private:
  SharedRegion* r_;
};
SharedPair MakeShared(const Stream& s) {
  KvCacheShape shape = MakeCache(s)->shape();
  shape.format = DecodeCacheFormat(s.header.kv_format);
  SharedPair p;
  p.owner = *SharedRegion::Create(KvCache::BytesFor(shape));
  auto peer = SharedRegion::Open(p.owner->name(), p.owner->size());
  EXPECT_TRUE(peer.ok()) << peer.status();
  p.peer = std::move(*peer);
  RegionAllocator a(p.owner.get()), b(p.peer.get());
  p.decode = *KvCache::Create(shape, a);
  p.prefill = *KvCache::Create(shape, b);
  return p;
}

// What the prefill node sends for chunk c once its assembler has written it into `view`.
WireChunk Placed(const WireChunk& c, const KvCache& view, const Stream& s) {
  return *PlacedChunk(c, view, s.header.kept_per_layer[c.layer], false);
}

// The shm transport: the prefill node's assembler writes each chunk into the decode node's
// cache through its own mapping, and the decode node's assembler, told only the rectangle and
// the checksum, accepts exactly what a stream through it would have stored, in every format.
TEST(KvWire, PlacedChunksHoldWhatTheStreamWouldHaveStored) {
  for (KvFormat f : {KvFormat::kAuto, KvFormat::kBF16, KvFormat::kFP8, KvFormat::kInt4}) {
    SCOPED_TRACE(KvFormatName(f));
    const Stream s = MakeStream(2, 3, 8, {60, 41}, 400, DType::kF32, 21, f);
    SharedPair p = MakeShared(s);
    KvAssembler sender(
        [&] {
          WireExpectation e = Expect(s);
          e.kept_per_layer.clear();
          return e;
        }(),
        p.prefill.get());
    WireExpectation e = Expect(s);
    e.placement = KvPlacement::kRowsAndPositions;
    KvAssembler receiver(e, p.decode.get());
    ASSERT_TRUE(sender.OnHeader(s.header).ok());
    ASSERT_TRUE(receiver.OnHeader(s.header).ok());
    for (const WireChunk& c : s.chunks) {
      ASSERT_TRUE(sender.OnChunk(c).ok());
      const absl::Status st = receiver.OnChunk(Placed(c, *p.prefill, s));
      ASSERT_TRUE(st.ok()) << st;
    }
    ASSERT_TRUE(receiver.OnTrailer(s.trailer, 512).ok());
    // The same rows and positions as the chunks stored the usual way.
    auto plain = KvCache::Create(p.decode->shape(), HeapKvAllocator());
    ASSERT_TRUE(Feed(s, plain->get()).ok());
    for (const WireChunk& c : s.chunks) {
      const int kept = s.header.kept_per_layer[c.layer];
      EXPECT_EQ(*PlacedChecksum(*p.decode, c, kept), *PlacedChecksum(**plain, c, kept));
    }
    for (int l = 0; l < 2; ++l) EXPECT_EQ(p.decode->layer(l).len, (*plain)->layer(l).len);
    if (f == KvFormat::kAuto) ExpectCacheEquals(s, *p.decode);
  }
}

TEST(KvWire, PlacedChunksAreCheckedWhereTheyLie) {
  const Stream s = MakeStream(1, 2, 8, {50}, 300, DType::kBF16, 4, KvFormat::kInt8);
  ASSERT_GE(s.chunks.size(), 2u);
  auto run = [&](const std::function<void(SharedPair&, WireChunk*)>& mutate) {
    SharedPair p = MakeShared(s);
    KvAssembler sender(Expect(s), p.prefill.get());
    WireExpectation e = Expect(s);
    e.placement = KvPlacement::kRowsAndPositions;
    KvAssembler receiver(e, p.decode.get());
    EXPECT_TRUE(sender.OnHeader(s.header).ok());
    EXPECT_TRUE(receiver.OnHeader(s.header).ok());
    absl::Status st;
    for (size_t i = 0; i < s.chunks.size() && st.ok(); ++i) {
      EXPECT_TRUE(sender.OnChunk(s.chunks[i]).ok());
      WireChunk placed = Placed(s.chunks[i], *p.prefill, s);
      if (i == 1) mutate(p, &placed);
      st = receiver.OnChunk(placed);
    }
    return st;
  };
  // A byte changed in the region after its checksum was taken: DATA_LOSS.
  absl::Status st = run([&](SharedPair& p, WireChunk* c) {
    p.prefill->layer(0).k[p.prefill->layer(0).layout.Row(c->head_begin, c->token_begin, 8)] ^= 1;
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("mismatch over the rows placed"), std::string::npos) << st;
  // Positions out of order, checksummed as they are (a sender that wrote them wrong).
  st = run([&](SharedPair& p, WireChunk* c) {
    LayerCache& lc = p.prefill->layer(0);
    std::swap(lc.positions[int64_t{c->head_begin} * lc.capacity + c->token_begin],
              lc.positions[int64_t{c->head_begin} * lc.capacity + c->token_begin + 1]);
    c->crc32c = *PlacedChecksum(*p.prefill, *c, s.header.kept_per_layer[0]);
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("positions must ascend"), std::string::npos) << st;
  // A payload on a placed chunk, and an impossible size.
  st = run([](SharedPair&, WireChunk* c) { c->k.assign(1, 'x'); });
  EXPECT_NE(st.message().find("yet it carries a payload"), std::string::npos) << st;
  st = run([](SharedPair&, WireChunk* c) { c->placed_bytes = 3; });
  EXPECT_NE(st.message().find("stands for 3 bytes"), std::string::npos) << st;
  // An unplaced chunk on a placed stream.
  st = run([&](SharedPair&, WireChunk* c) { *c = s.chunks[1]; });
  EXPECT_NE(st.message().find("its rows travel in it"), std::string::npos) << st;
  // And a placed chunk on a stream whose rows travel in it.
  auto cache = MakeCache(s);
  KvAssembler plain(Expect(s), cache.get());
  ASSERT_TRUE(plain.OnHeader(s.header).ok());
  SharedPair p = MakeShared(s);
  KvAssembler sender(Expect(s), p.prefill.get());
  ASSERT_TRUE(sender.OnHeader(s.header).ok());
  ASSERT_TRUE(sender.OnChunk(s.chunks[0]).ok());
  st = plain.OnChunk(Placed(s.chunks[0], *p.prefill, s));
  EXPECT_NE(st.message().find("placed in the cache, but its rows travel"), std::string::npos) << st;
}

// The cuda_ipc shape: the decode node's cache in pages of a device pool, the prefill node's view
// of the same pages through its own backend's mapping of the exported slab (two guarded
// backends: each maps the memory at its own address, as two processes would).
struct PagedPair {
  kernels::KernelBackendPtr decode_backend, prefill_backend;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<KvCache> decode, prefill;
  void* mapped = nullptr;
  ~PagedPair() {
    prefill.reset();
    if (mapped != nullptr) prefill_backend->CloseImported(mapped);
  }
};
// Two guarded backends, one with a pool of 16 KiB pages the decode cache of `s` goes in (the
// decode node's), and that cache's shape.
template <typename Pair>
KvCacheShape MakeDevicePair(const Stream& s, Pair* p) {
  p->decode_backend = *kernels::MakeBackend(kernels::BackendKind::kGuarded, 1);
  p->prefill_backend = *kernels::MakeBackend(kernels::BackendKind::kGuarded, 1);
  KvCacheShape shape = MakeCache(s)->shape();
  shape.format = DecodeCacheFormat(s.header.kv_format);
  auto pool = KvPool::OnBackend(
      std::shared_ptr<kernels::KernelBackend>(p->decode_backend.get(), [](auto*) {}),
      size_t{4} << 20, size_t{16} << 10);
  EXPECT_TRUE(pool.ok()) << pool.status();
  p->pool = std::move(*pool);
  return shape;
}
std::unique_ptr<PagedPair> MakePaged(const Stream& s) {
  auto p = std::make_unique<PagedPair>();
  const KvCacheShape shape = MakeDevicePair(s, p.get());
  // A cache that is not the pool's first: its pages start past others.
  auto before = KvCache::CreatePaged(shape, *p->pool);
  auto decode = KvCache::CreatePaged(shape, *p->pool);
  EXPECT_TRUE(decode.ok()) << decode.status();
  p->decode = std::move(*decode);
  auto handle = p->decode_backend->ExportMemory(p->pool->slab(), p->pool->capacity());
  EXPECT_TRUE(handle.ok()) << handle.status();
  p->mapped = *p->prefill_backend->ImportMemory(*handle, p->pool->capacity());
  auto view =
      KvCache::CreatePagedView(shape, p->prefill_backend.get(), static_cast<uint8_t*>(p->mapped),
                               p->pool->capacity(), *p->decode->paged_place());
  EXPECT_TRUE(view.ok()) << view.status();
  p->prefill = std::move(*view);
  return p;
}

// What the prefill node sends on cuda_ipc: the rectangle, the positions, the checksum over the
// pages it wrote, computed on its device.
WireChunk PlacedRows(const WireChunk& c, const KvCache& view, const Stream& s) {
  return *PlacedChunk(c, view, s.header.kept_per_layer[c.layer], true);
}

// cuda_ipc: the prefill node's assembler writes each chunk's rows into the decode node's pages
// through its mapping of the pool; the decode node stores the positions the chunks carry and
// checks the pages by their checksum on its own device: it then holds what a stream through it
// would have stored, in every format.
TEST(KvWire, PlacedRowsInDevicePagesHoldWhatTheStreamWouldHaveStored) {
  for (KvFormat f : {KvFormat::kAuto, KvFormat::kBF16, KvFormat::kFP8, KvFormat::kInt4}) {
    SCOPED_TRACE(KvFormatName(f));
    const Stream s = MakeStream(2, 3, 8, {60, 41}, 400, DType::kF32, 23, f);
    auto p = MakePaged(s);
    ASSERT_NE(p->prefill, nullptr);
    WireExpectation plain_expect = Expect(s);
    plain_expect.kept_per_layer.clear();
    KvAssembler sender(plain_expect, p->prefill.get());
    WireExpectation e = Expect(s);
    e.placement = KvPlacement::kRows;
    KvAssembler receiver(e, p->decode.get());
    ASSERT_TRUE(sender.OnHeader(s.header).ok());
    ASSERT_TRUE(receiver.OnHeader(s.header).ok());
    for (const WireChunk& c : s.chunks) {
      ASSERT_TRUE(sender.OnChunk(c).ok());
      const absl::Status st = receiver.OnChunk(PlacedRows(c, *p->prefill, s));
      ASSERT_TRUE(st.ok()) << st;
    }
    ASSERT_TRUE(receiver.OnTrailer(s.trailer, 512).ok());
    EXPECT_EQ(receiver.payload_bytes(), s.trailer.kv_payload_bytes);
    // Every chunk's rows and positions in the pages as a host cache fed the usual way holds them
    // (the checksum is the same function of both, the rows' CRCs computed where they are).
    auto plain = KvCache::Create(p->decode->shape(), HeapKvAllocator());
    ASSERT_TRUE(Feed(s, plain->get()).ok());
    for (const WireChunk& c : s.chunks) {
      const int kept = s.header.kept_per_layer[c.layer];
      EXPECT_EQ(*PlacedChecksum(*p->decode, c, kept), *PlacedChecksum(**plain, c, kept));
    }
    for (int l = 0; l < 2; ++l) EXPECT_EQ(p->decode->layer(l).len, (*plain)->layer(l).len);
  }
}

TEST(KvWire, PlacedRowsAreCheckedInThePages) {
  const Stream s = MakeStream(1, 2, 8, {50}, 300, DType::kBF16, 5, KvFormat::kInt8);
  ASSERT_GE(s.chunks.size(), 2u);
  auto run = [&](const std::function<void(PagedPair&, WireChunk*)>& mutate) {
    auto p = MakePaged(s);
    KvAssembler sender(Expect(s), p->prefill.get());
    WireExpectation e = Expect(s);
    e.placement = KvPlacement::kRows;
    KvAssembler receiver(e, p->decode.get());
    EXPECT_TRUE(sender.OnHeader(s.header).ok());
    EXPECT_TRUE(receiver.OnHeader(s.header).ok());
    absl::Status st;
    for (size_t i = 0; i < s.chunks.size() && st.ok(); ++i) {
      EXPECT_TRUE(sender.OnChunk(s.chunks[i]).ok());
      WireChunk placed = PlacedRows(s.chunks[i], *p->prefill, s);
      if (i == 1) mutate(*p, &placed);
      st = receiver.OnChunk(placed);
    }
    return st;
  };
  EXPECT_TRUE(run([](PagedPair&, WireChunk*) {}).ok());
  // A byte of the pages changed after the checksum was taken (through the prefill's mapping).
  absl::Status st = run([&](PagedPair& p, WireChunk* c) {
    const LayerCache& lc = p.prefill->layer(0);
    uint8_t* at =
        lc.k + lc.layout.Row(c->head_begin, c->token_begin, CodedKeyRowBytes(KvFormat::kInt8, 8));
    uint8_t b = 0;
    ASSERT_TRUE(p.prefill_backend->CopyToHost(&b, at, 1).ok());
    b ^= 1;
    ASSERT_TRUE(p.prefill_backend->CopyToDevice(at, &b, 1).ok());
    ASSERT_TRUE(p.prefill_backend->Synchronize().ok());
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("placed in the cache's pages"), std::string::npos) << st;
  // A position that differs from those the checksum covered (still ascending, in the prompt).
  st = run([&](PagedPair&, WireChunk* c) {
    std::vector<int32_t> pos(static_cast<size_t>(c->head_count) * c->token_count);
    size_t offset = 0;
    for (int h = 0; h < c->head_count; ++h) {
      ASSERT_TRUE(DecodePositions(c->positions, &offset, c->token_count, s.header.prompt_len,
                                  pos.data() + static_cast<size_t>(h) * c->token_count)
                      .ok());
    }
    int32_t& last = pos[c->token_count - 1];
    ASSERT_LT(last + 1, s.header.prompt_len);
    ++last;
    std::string other;
    for (int h = 0; h < c->head_count; ++h) {
      EncodePositions(pos.data() + static_cast<size_t>(h) * c->token_count, c->token_count, &other);
    }
    c->placed_bytes +=
        static_cast<int64_t>(other.size()) - static_cast<int64_t>(c->positions.size());
    c->positions = other;
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  // Rows carried on a cuda_ipc chunk, positions missing, and a size that is not rows + positions.
  st = run([](PagedPair&, WireChunk* c) { c->v.assign(1, 'x'); });
  EXPECT_NE(st.message().find("must carry its positions only"), std::string::npos) << st;
  st = run([](PagedPair&, WireChunk* c) { c->positions.clear(); });
  EXPECT_NE(st.message().find("must carry its positions only"), std::string::npos) << st;
  st = run([](PagedPair&, WireChunk* c) { c->placed_bytes -= 1; });
  EXPECT_NE(st.message().find("and its positions"), std::string::npos) << st;
}

// The prefill node lays the decode node's cache out from what the request says, and every
// table and offset must fit the shape and the slab.
TEST(KvCache, PagedViewChecksWhereTheCacheLies) {
  const Stream s = MakeStream(2, 3, 8, {60, 41}, 400, DType::kF32, 2, KvFormat::kInt4);
  auto p = MakePaged(s);
  const KvCacheShape& shape = p->decode->shape();
  const KvCache::PagedPlace good = *p->decode->paged_place();
  auto view = [&](const KvCache::PagedPlace& place, size_t slab = 0) {
    return KvCache::CreatePagedView(shape, p->prefill_backend.get(),
                                    static_cast<uint8_t*>(p->mapped),
                                    slab ? slab : p->pool->capacity(), place)
        .status();
  };
  EXPECT_TRUE(view(good).ok());
  KvCache::PagedPlace bad = good;
  bad.tables[1].back() = static_cast<int32_t>(p->pool->capacity() / good.page_bytes);
  EXPECT_NE(view(bad).message().find("names page"), std::string::npos) << view(bad);
  bad = good;
  bad.tables[0].pop_back();
  EXPECT_NE(view(bad).message().find("page table lists"), std::string::npos) << view(bad);
  bad = good;
  bad.tables.pop_back();
  EXPECT_FALSE(view(bad).ok());
  bad = good;
  bad.side_offset = -1;  // a coded cache's state must be somewhere
  EXPECT_NE(view(bad).message().find("coded state"), std::string::npos) << view(bad);
  bad.side_offset = static_cast<int64_t>(p->pool->capacity());
  EXPECT_FALSE(view(bad).ok());
  bad = good;
  bad.page_bytes = 0;
  EXPECT_FALSE(view(bad).ok());
  EXPECT_FALSE(view(good, good.page_bytes / 2).ok());  // a slab smaller than a page
  // A cache in host memory has no pages to name.
  EXPECT_EQ(MakeCache(s)->paged_place().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SharedRegion, IsOpenedByNameAtItsSizeUntilItsOwnerGoes) {
  auto owner = SharedRegion::Create(10000);
  ASSERT_TRUE(owner.ok()) << owner.status();
  EXPECT_TRUE(IsSharedRegionName((*owner)->name())) << (*owner)->name();
  auto peer = SharedRegion::Open((*owner)->name(), 10000);
  ASSERT_TRUE(peer.ok()) << peer.status();
  (*owner)->data()[9999] = 42;  // one memory, two mappings
  EXPECT_EQ((*peer)->data()[9999], 42);
  EXPECT_EQ(SharedRegion::Open((*owner)->name(), 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SharedRegion::Open("/etc-passwd", 10000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedRegion::Open("/kvwire-1-00", 10000).status().code(), absl::StatusCode::kNotFound);
  const std::string name = (*owner)->name();
  owner->reset();  // unlinked: no one opens it again, and the peer's mapping stays good
  EXPECT_EQ(SharedRegion::Open(name, 10000).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*peer)->data()[9999], 42);
}

}  // namespace
// nccl: the two ends of a link between a prefill node (a host copy of the decode cache,
// assembled from the stream) and a decode node (pages of a device pool), both on guarded
// backends whose links emulate NCCL. Each chunk's rows, packed, land in the pages, which then
// hold what a stream fed the usual way would have stored; the link is lent again after a
// whole stream, its messages numbered on; receives wait for their turn; a wrong size, a
// missing message and a stream that did not end whole each end the link.
struct LinkPair {
  kernels::KernelBackendPtr decode_backend, prefill_backend;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<KvCache> decode, prefill;
  std::unique_ptr<SenderLinks> sender;
  std::unique_ptr<ReceiverLinks> receiver;
};
std::unique_ptr<LinkPair> MakeLinkPair(const Stream& s) {
  auto p = std::make_unique<LinkPair>();
  const KvCacheShape shape = MakeDevicePair(s, p.get());
  p->decode = *KvCache::CreatePaged(shape, *p->pool);
  p->prefill = *KvCache::Create(shape, HeapKvAllocator());
  p->sender = std::make_unique<SenderLinks>(p->prefill_backend.get());
  p->receiver = std::make_unique<ReceiverLinks>(p->decode_backend.get());
  return p;
}

// What the prefill node sends for chunk `c` on `link`: the chunk's message, and (`message`) its
// rows packed; the host copy takes the chunk first.
WireChunk LinkChunk(LinkPair& p, KvAssembler& copy, KvLink& link, const Stream& s,
                    const WireChunk& c, std::vector<uint8_t>* message) {
  EXPECT_TRUE(copy.OnChunk(c).ok());
  const int kept = s.header.kept_per_layer[c.layer];
  WireChunk placed = *PlacedChunk(c, *p.prefill, kept, true);
  EXPECT_TRUE(p.sender->Prepare(link, *p.prefill, kept, &placed, message).ok());
  return placed;
}

TEST(KvLinks, CarryEachChunksRowsIntoThePages) {
  constexpr auto kWait = std::chrono::milliseconds(5000);
  for (KvFormat f : {KvFormat::kAuto, KvFormat::kFP8, KvFormat::kInt4}) {
    SCOPED_TRACE(KvFormatName(f));
    const Stream s = MakeStream(2, 3, 8, {60, 41}, 400, DType::kF32, 23, f);
    ASSERT_GE(s.chunks.size(), 3u);
    auto p = MakeLinkPair(s);
    std::string offer;
    auto link = p->sender->Acquire(p->receiver->peer(), &offer);
    ASSERT_TRUE(link.ok()) << link.status();
    ASSERT_FALSE(offer.empty());
    auto end = p->receiver->Use((*link)->name(), offer);
    ASSERT_TRUE(end.ok()) << end.status();
    WireExpectation plain = Expect(s);
    plain.kept_per_layer.clear();
    KvAssembler copy(plain, p->prefill.get());
    WireExpectation e = Expect(s);
    e.placement = KvPlacement::kRows;
    KvAssembler receiver(e, p->decode.get());
    ASSERT_TRUE(copy.OnHeader(s.header).ok());
    ASSERT_TRUE(receiver.OnHeader(s.header).ok());
    // Messages 0 and 1 are received in the other order (two streams' threads at a hand-over):
    // the second waits for the first.
    std::vector<std::vector<uint8_t>> messages(s.chunks.size());
    std::vector<WireChunk> placed;
    for (size_t i = 0; i < s.chunks.size(); ++i) {
      placed.push_back(LinkChunk(*p, copy, **link, s, s.chunks[i], &messages[i]));
      EXPECT_EQ(placed[i].link_seq, i);
      EXPECT_EQ(static_cast<size_t>(placed[i].link_bytes), messages[i].size());
    }
    std::thread sending([&] {
      for (const auto& m : messages) EXPECT_TRUE(p->sender->Send(**link, m, kWait).ok());
    });
    auto kept = [&](const WireChunk& c) { return s.header.kept_per_layer[c.layer]; };
    absl::Status second;
    std::thread later([&] {
      second = p->receiver->Receive(**end, placed[1], *p->decode, kept(placed[1]), kWait);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_TRUE(receiver.CheckNext(placed[0]).ok());
    ASSERT_TRUE(p->receiver->Receive(**end, placed[0], *p->decode, kept(placed[0]), kWait).ok());
    later.join();
    ASSERT_TRUE(second.ok()) << second;
    for (size_t i = 0; i < placed.size(); ++i) {
      if (i >= 2) {
        ASSERT_TRUE(receiver.CheckNext(placed[i]).ok());
        const absl::Status st =
            p->receiver->Receive(**end, placed[i], *p->decode, kept(placed[i]), kWait);
        ASSERT_TRUE(st.ok()) << st;
      }
      const absl::Status st = receiver.OnChunk(placed[i]);  // the checksum over the pages
      ASSERT_TRUE(st.ok()) << st;
    }
    sending.join();
    ASSERT_TRUE(receiver.OnTrailer(s.trailer, 512).ok());
    auto fed = KvCache::Create(p->decode->shape(), HeapKvAllocator());
    ASSERT_TRUE(Feed(s, fed->get()).ok());
    for (const WireChunk& c : s.chunks) {
      EXPECT_EQ(*PlacedChecksum(*p->decode, c, kept(c)), *PlacedChecksum(**fed, c, kept(c)));
    }
    // The stream ended whole: both ends keep the link, and the next stream gets it warm, its
    // messages numbered on from the last.
    const std::string name = (*link)->name();
    p->receiver->Done(*end, true);
    p->sender->Release(p->receiver->peer(), *std::move(link));
    EXPECT_EQ(p->sender->idle(), 1);
    auto again = p->sender->Acquire(p->receiver->peer(), &offer);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(offer.empty());
    EXPECT_EQ((*again)->name(), name);
    auto end2 = p->receiver->Use(name, "");
    ASSERT_TRUE(end2.ok()) << end2.status();
    EXPECT_EQ(p->receiver->open(), 1);
    auto pages = KvCache::CreatePaged(p->decode->shape(), *p->pool);
    ASSERT_TRUE(pages.ok());
    KvAssembler copy2(plain, p->prefill.get()), receiver2(e, pages->get());
    ASSERT_TRUE(copy2.OnHeader(s.header).ok());
    ASSERT_TRUE(receiver2.OnHeader(s.header).ok());
    std::vector<uint8_t> m;
    WireChunk c = LinkChunk(*p, copy2, **again, s, s.chunks[0], &m);
    EXPECT_EQ(c.link_seq, s.chunks.size());
    std::thread send2([&] { EXPECT_TRUE(p->sender->Send(**again, m, kWait).ok()); });
    ASSERT_TRUE(receiver2.CheckNext(c).ok());
    ASSERT_TRUE(p->receiver->Receive(**end2, c, **pages, kept(c), kWait).ok());
    send2.join();
    EXPECT_TRUE(receiver2.OnChunk(c).ok());
    // A byte changed on the link: the rows land, and the checksum over the pages refuses them.
    WireChunk bent = LinkChunk(*p, copy2, **again, s, s.chunks[1], &m);
    m[m.size() / 2] ^= 0x10;
    std::thread send3([&] { EXPECT_TRUE(p->sender->Send(**again, m, kWait).ok()); });
    ASSERT_TRUE(receiver2.CheckNext(bent).ok());
    ASSERT_TRUE(p->receiver->Receive(**end2, bent, **pages, kept(bent), kWait).ok());
    send3.join();
    absl::Status st = receiver2.OnChunk(bent);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    // A message whose size is not the cache's for the chunk: the link is out of step, and ends.
    WireChunk wrong = LinkChunk(*p, copy2, **again, s, s.chunks[2], &m);
    wrong.link_bytes += 1;
    st = p->receiver->Receive(**end2, wrong, **pages, kept(wrong), kWait);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("bytes on the link"), std::string::npos) << st;
    st = p->receiver->Receive(**end2, c, **pages, kept(c), kWait);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
    // Not whole: the decode node drops it, and a stream the prefill node puts on it fails.
    p->receiver->Done(*end2, false);
    EXPECT_EQ(p->receiver->open(), 0);
    st = p->receiver->Use(name, "").status();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("does not hold"), std::string::npos) << st;
    EXPECT_EQ(p->receiver->Use("", "").status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// A message that never comes: the receive gives up after its timeout, and the link with it.
TEST(KvLinks, AReceiveNothingArrivesForEndsTheLink) {
  const Stream s = MakeStream(1, 2, 8, {30}, 1 << 20, DType::kBF16, 3);
  auto p = MakeLinkPair(s);
  std::string offer;
  auto link = p->sender->Acquire(p->receiver->peer(), &offer);
  ASSERT_TRUE(link.ok());
  auto end = p->receiver->Use((*link)->name(), offer);
  ASSERT_TRUE(end.ok());
  EXPECT_EQ(p->receiver->Use((*link)->name(), offer).status().code(),
            absl::StatusCode::kInvalidArgument);  // offered twice
  KvAssembler copy(Expect(s), p->prefill.get());
  ASSERT_TRUE(copy.OnHeader(s.header).ok());
  std::vector<uint8_t> m;
  const WireChunk c = LinkChunk(*p, copy, **link, s, s.chunks[0], &m);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status st = p->receiver->Receive(**end, c, *p->decode, 30, std::chrono::milliseconds(300));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(250));
  // A later message, which waits for its turn, is not waited for either.
  WireChunk later = c;
  later.link_seq = 5;
  st = p->receiver->Receive(**end, later, *p->decode, 30, std::chrono::milliseconds(5000));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  // The sender's end finds its peer gone once the decode node drops the link.
  p->receiver->Done(*end, false);
  end->reset();
  absl::Status sent;
  for (int i = 0; i < 50 && sent.ok(); ++i) {
    sent = p->sender->Send(**link, m, std::chrono::milliseconds(200));
  }
  EXPECT_FALSE(sent.ok());
}

}  // namespace kvwire
