#include "common/engine/kv_pool.h"

#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvwire {

class PooledMemory final : public KvMemory {
 public:
  PooledMemory(KvPool* pool, uint8_t* data, size_t size, size_t reserved)
      : pool_(pool), data_(data), size_(size), reserved_(reserved) {}
  ~PooledMemory() override {
    std::free(data_);
    pool_->Release(reserved_);
  }
  uint8_t* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  KvPool* pool_;
  uint8_t* data_;
  size_t size_, reserved_;
};

KvPool::KvPool(size_t capacity_bytes, size_t page_bytes, std::function<void()> on_release)
    : capacity_(capacity_bytes),
      page_bytes_(page_bytes == 0 ? 1 : page_bytes),
      on_release_(std::move(on_release)) {}

size_t KvPool::RoundUp(size_t bytes) const {
  return (bytes + page_bytes_ - 1) / page_bytes_ * page_bytes_;
}

absl::StatusOr<KvMemoryPtr> KvPool::Allocate(size_t bytes) {
  const size_t reserved = RoundUp(bytes == 0 ? 1 : bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reserved > capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the request needs ", reserved, " bytes of KV cache but the pool holds ", capacity_,
          " (--kv-pool-bytes); lower max_tokens or the compression budget"));
    }
    if (used_.load() + reserved > capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat("KV pool full: ", used_.load(), " of ",
                                                       capacity_, " bytes in use, ", reserved,
                                                       " needed"));
    }
    used_ += reserved;
  }
  uint8_t* data = AllocateHostBytes(bytes);
  if (data == nullptr) {
    Release(reserved);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return KvMemoryPtr(new PooledMemory(this, data, bytes, reserved));
}

void KvPool::Release(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    used_ -= bytes;
  }
  if (on_release_) on_release_();
}

absl::StatusOr<size_t> ParseBytes(const std::string& text) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  size_t mult = 1;
  for (const auto& [suffix, m] : std::vector<std::pair<std::string, size_t>>{{"kib", 1ull << 10},
                                                                             {"mib", 1ull << 20},
                                                                             {"gib", 1ull << 30},
                                                                             {"tib", 1ull << 40},
                                                                             {"kb", 1ull << 10},
                                                                             {"mb", 1ull << 20},
                                                                             {"gb", 1ull << 30},
                                                                             {"k", 1ull << 10},
                                                                             {"m", 1ull << 20},
                                                                             {"g", 1ull << 30},
                                                                             {"b", 1}}) {
    if (s.size() > suffix.size() &&
        s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
      mult = m;
      s.resize(s.size() - suffix.size());
      break;
    }
  }
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !(v >= 0) || v * mult > 1e18) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a byte size (e.g. 4GiB, 512MiB)"));
  }
  return static_cast<size_t>(v * mult);
}

}  // namespace kvwire
