#include "kernels/guarded_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "kernels/cpu_backend.h"
#include "kernels/validate.h"

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
  absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Run("CopyToDevice", {{dst, "dst"}}, [&] {
      if (bytes > 0) std::memcpy(dst, src, bytes);  // data() of an empty array may be null
      return absl::OkStatus();
    });
  }
  absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) override {
    return Run("CopyToHost", {{src, "src"}}, [&] {
      if (bytes > 0) std::memcpy(dst, src, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  // Host work (sparse selection) on the CPU backend's threads, as the CUDA backend's pool.
  void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) override {
    inner_->HostParallelFor(n, fn);
  }

  // Every pointer an op's parameters carry must be this backend's memory, as a GPU kernel's
  // must be device memory (the tables of sequences themselves are host arrays, as the CUDA
  // backend uploads them).
  absl::Status MatMul(const MatMulParams& p) override {
    RETURN_IF_ERROR(ValidateMatMul(p));  // shapes first, as the CUDA backend
    return Run("MatMul", {{p.x, "x"}, {p.w, "w"}, {p.bias, "bias"}, {p.y, "y"}},
               [&] { return inner_->MatMul(p); });
  }
  absl::Status RmsNorm(const RmsNormParams& p) override {
    RETURN_IF_ERROR(ValidateRmsNorm(p));  // shapes first, as the CUDA backend
    return Run("RmsNorm", {{p.x, "x"}, {p.weight, "weight"}, {p.y, "y"}},
               [&] { return inner_->RmsNorm(p); });
  }
  absl::Status Rope(const RopeParams& p) override {
    RETURN_IF_ERROR(ValidateRope(p));  // shapes first, as the CUDA backend
    return Run("Rope", {{p.x, "x"}, {p.positions, "positions"}, {p.inv_freq, "inv_freq"}},
               [&] { return inner_->Rope(p); });
  }
  absl::Status SwiGlu(const SwiGluParams& p) override {
    RETURN_IF_ERROR(ValidateSwiGlu(p));  // shapes first, as the CUDA backend
    return Run("SwiGlu", {{p.gate_up, "gate_up"}, {p.out, "out"}},
               [&] { return inner_->SwiGlu(p); });
  }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    RETURN_IF_ERROR(ValidatePrefillAttention(p));  // shapes first, as the CUDA backend
    return Run("PrefillAttention",
               {{p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.out, "out"}, {p.window_scores, "scores"}},
               [&] { return inner_->PrefillAttention(p); });
  }
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    RETURN_IF_ERROR(ValidateDecodeAttention(p));  // shapes first, as the CUDA backend
    std::vector<Pointer> ptrs;
    for (int b = 0; b < p.batch && p.seqs; ++b) {
      const DecodeSequence& s = p.seqs[b];
      ptrs.insert(ptrs.end(), {{s.q, "q"},
                               {s.out, "out"},
                               {s.k, "k"},
                               {s.v, "v"},
                               {s.indices, "indices"},
                               {s.probs, "probs"}});
    }
    return Run("DecodeAttention", ptrs, [&] { return inner_->DecodeAttention(p); });
  }
  absl::Status Add(const AddParams& p) override {
    RETURN_IF_ERROR(ValidateAdd(p));  // shapes first, as the CUDA backend
    return Run("Add", {{p.x, "x"}, {p.y, "y"}}, [&] { return inner_->Add(p); });
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    RETURN_IF_ERROR(ValidateAppendKv(p));  // shapes first, as the CUDA backend
    std::vector<Pointer> ptrs;
    for (int b = 0; b < p.batch && p.seqs; ++b) {
      const KvAppend& s = p.seqs[b];
      ptrs.insert(ptrs.end(),
                  {{s.k, "k"}, {s.v, "v"}, {s.k_cache, "k_cache"}, {s.v_cache, "v_cache"}});
    }
    return Run("AppendKv", ptrs, [&] { return inner_->AppendKv(p); });
  }

  absl::Status WindowVotes(const WindowVotesParams& p) override {
    RETURN_IF_ERROR(ValidateWindowVotes(p));
    return Run("WindowVotes", {{p.scores, "scores"}, {p.votes, "votes"}},
               [&] { return inner_->WindowVotes(p); });
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    RETURN_IF_ERROR(ValidatePool1d(p));
    return Run("Pool1d", {{p.x, "x"}, {p.y, "y"}}, [&] { return inner_->Pool1d(p); });
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    RETURN_IF_ERROR(ValidateRunMeans(p));
    return Run("RunMeans", {{p.x, "x"}, {p.y, "y"}}, [&] { return inner_->RunMeans(p); });
  }
  absl::Status TopK(const TopKParams& p) override {
    RETURN_IF_ERROR(ValidateTopK(p));
    std::vector<Pointer> ptrs;
    for (int i = 0; i < p.count; ++i) {
      ptrs.insert(ptrs.end(),
                  {{p.segs[i].score, "score"}, {p.segs[i].tie, "tie"}, {p.segs[i].out, "out"}});
    }
    return Run("TopK", ptrs, [&] { return inner_->TopK(p); });
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    RETURN_IF_ERROR(ValidateHbwSelect(p));
    return Run("HbwSelect", {{p.block_scores, "block_scores"}, {p.out, "out"}},
               [&] { return inner_->HbwSelect(p); });
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    RETURN_IF_ERROR(ValidateGatherKv(p));
    return Run("GatherKv",
               {{p.k, "k"}, {p.v, "v"}, {p.kept, "kept"}, {p.k_out, "k_out"}, {p.v_out, "v_out"}},
               [&] { return inner_->GatherKv(p); });
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    RETURN_IF_ERROR(ValidateUpdateSummaries(p));
    std::vector<Pointer> ptrs;
    for (int i = 0; i < p.count; ++i) {
      ptrs.insert(ptrs.end(), {{p.segs[i].k, "k"}, {p.segs[i].summaries, "summaries"}});
    }
    return Run("UpdateSummaries", ptrs, [&] { return inner_->UpdateSummaries(p); });
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    RETURN_IF_ERROR(ValidatePageScores(p));
    std::vector<Pointer> ptrs;
    for (int i = 0; i < p.count; ++i) {
      const PageScoreSegment& s = p.segs[i];
      ptrs.insert(ptrs.end(),
                  {{s.q, "q"}, {s.summaries, "summaries"}, {s.k, "k"}, {s.score, "score"}});
    }
    return Run("PageScores", ptrs, [&] { return inner_->PageScores(p); });
  }
  absl::Status Sample(const SampleParams& p) override {
    RETURN_IF_ERROR(ValidateSample(p));
    return Run("Sample", {{p.logits, "logits"}, {p.out, "out"}}, [&] { return inner_->Sample(p); });
  }

 private:
  struct Pointer {
    const void* p;
    const char* name;
  };
  // Null, or inside one of this backend's buffers.
  bool Owned(const void* p) const {
    if (p == nullptr) return true;
    auto it = regions_.upper_bound(const_cast<void*>(p));
    if (it == regions_.begin()) return false;
    --it;
    return static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second;
  }
  // Checks `ptrs`, then opens every buffer for the duration of one op and closes them again.
  template <typename F>
  absl::Status Run(const char* op_name, const std::vector<Pointer>& ptrs, F&& op) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Pointer& x : ptrs) {
      if (!Owned(x.p)) {
        return absl::InvalidArgumentError(
            absl::StrCat("guarded backend: ", op_name, "'s ", x.name,
                         " is not memory of this backend (a host pointer where a device one is "
                         "needed)"));
      }
    }
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
