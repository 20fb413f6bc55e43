#include "kernels/guarded_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kernels/cpu_backend.h"

namespace kvwire::kernels {
namespace {

class GuardedBackend final : public KernelBackend {
 public:
  explicit GuardedBackend(int threads)
      : inner_(MakeCpuBackend(threads)), page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))) {}
  ~GuardedBackend() override {
    for (auto& [p, bytes] : regions_) munmap(p, bytes);
  }

  BackendKind kind() const override { return BackendKind::kGuarded; }
  bool host_addressable() const override { return false; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t mapped = (std::max<size_t>(bytes, 1) + page_ - 1) / page_ * page_;
    void* p = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("guarded backend: cannot map ", bytes, " bytes: ", std::strerror(errno)));
    }
    regions_[p] = mapped;
    return p;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(ptr);
    if (it == regions_.end()) return;
    munmap(it->first, it->second);
    regions_.erase(it);
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Run([&] {
      if (bytes > 0) std::memcpy(dst, src, bytes);  // data() of an empty array may be null
      return absl::OkStatus();
    });
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Run([&] {
      if (bytes > 0) std::memcpy(dst, src, bytes);  // data() of an empty array may be null
      return absl::OkStatus();
    });
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status MatMul(const MatMulParams& p) override {
    return Run([&] { return inner_->MatMul(p); });
  }
  absl::Status RmsNorm(const RmsNormParams& p) override {
    return Run([&] { return inner_->RmsNorm(p); });
  }
  absl::Status Rope(const RopeParams& p) override {
    return Run([&] { return inner_->Rope(p); });
  }
  absl::Status SwiGlu(const SwiGluParams& p) override {
    return Run([&] { return inner_->SwiGlu(p); });
  }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    return Run([&] { return inner_->PrefillAttention(p); });
  }
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    return Run([&] { return inner_->DecodeAttention(p); });
  }
  absl::Status Add(const AddParams& p) override {
    return Run([&] { return inner_->Add(p); });
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    return Run([&] { return inner_->AppendKv(p); });
  }

 private:
  // Opens every buffer for the duration of one op, then closes them again.
  template <typename F>
  absl::Status Run(F&& op) {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(Protect(PROT_READ | PROT_WRITE));
    const absl::Status st = op();
    RETURN_IF_ERROR(Protect(PROT_NONE));
    return st;
  }
  absl::Status Protect(int prot) {
    for (auto& [p, bytes] : regions_) {
      if (mprotect(p, bytes, prot) != 0) {
        return absl::InternalError(
            absl::StrCat("guarded backend: mprotect: ", std::strerror(errno)));
      }
    }
    return absl::OkStatus();
  }

  KernelBackendPtr inner_;
  const size_t page_;
  std::mutex mu_;
  std::map<void*, size_t> regions_;
};

}  // namespace

KernelBackendPtr MakeGuardedBackend(int threads) {
  return std::make_unique<GuardedBackend>(threads);
}

}  // namespace kvwire::kernels
