#include "kernels/cuda/nccl_link.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace kvwire::kernels::cuda {
namespace {

// The entry points this link uses, from the library found at run time.
struct NcclApi {
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  const char* (*GetErrorString)(ncclResult_t);
};

absl::StatusOr<const NcclApi*> Nccl() {
  static const absl::StatusOr<NcclApi>* api = [] {
    const char* env = std::getenv("KVWIRE_NCCL_LIBRARY");
    const std::string path = env != nullptr && *env != '\0' ? env : "libnccl.so.2";
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      return new absl::StatusOr<NcclApi>(absl::FailedPreconditionError(absl::StrCat(
          "the nccl KV transport needs NCCL: cannot load ", path, " (", why ? why : "?",
          "); install it (the nvidia-nccl-cu13 wheel or the CUDA toolkit's) and put it on "
          "LD_LIBRARY_PATH, or name it in KVWIRE_NCCL_LIBRARY")));
    }
    NcclApi a{};
    bool ok = true;
    auto get = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && *fn != nullptr;
    };
    get(&a.GetUniqueId, "ncclGetUniqueId");
    get(&a.CommInitRankConfig, "ncclCommInitRankConfig");
    get(&a.CommGetAsyncError, "ncclCommGetAsyncError");
    get(&a.CommAbort, "ncclCommAbort");
    get(&a.Send, "ncclSend");
    get(&a.Recv, "ncclRecv");
    get(&a.GetErrorString, "ncclGetErrorString");
    if (!ok) {
      return new absl::StatusOr<NcclApi>(absl::FailedPreconditionError(absl::StrCat(
          path, " lacks an entry point of NCCL 2.14 or later (ncclCommInitRankConfig, ...)")));
    }
    return new absl::StatusOr<NcclApi>(a);
  }();
  if (!api->ok()) return api->status();
  return &**api;
}

absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

// Two ranks; every operation polls the communicator's state (it is non-blocking, so that a
// peer that went away fails a wait instead of hanging it) and its stream's event, up to the
// deadline, then aborts.
class NcclLink final : public PeerLink {
 public:
  NcclLink(const NcclApi* api, int rank) : api_(api), peer_(1 - rank) {}
  ~NcclLink() override {
    Abort();
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const ncclUniqueId& id, int rank) {
    RETURN_IF_ERROR(CudaError(cudaGetDevice(&device_), "cudaGetDevice"));
    RETURN_IF_ERROR(CudaError(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                              "cudaStreamCreate (nccl link)"));
    RETURN_IF_ERROR(CudaError(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming),
                              "cudaEventCreate (nccl link)"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r = api_->CommInitRankConfig(&comm_, 2, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm_ = nullptr;
      return Failed(r, "ncclCommInitRankConfig");
    }
    return absl::OkStatus();
  }

  absl::Status Send(const void* data, size_t bytes, std::chrono::milliseconds timeout) override {
    return Run([&] { return api_->Send(data, bytes, ncclUint8, peer_, comm_, stream_); },
               "ncclSend", timeout);
  }
  absl::Status Recv(void* data, size_t bytes, std::chrono::milliseconds timeout) override {
    return Run([&] { return api_->Recv(data, bytes, ncclUint8, peer_, comm_, stream_); },
               "ncclRecv", timeout);
  }
  void Abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ != nullptr) api_->CommAbort(comm_);  // stops what is queued on the stream
    comm_ = nullptr;
  }

 private:
  absl::Status Failed(ncclResult_t r, const char* what) {
    return absl::UnavailableError(absl::StrCat("nccl link: ", what, ": ", api_->GetErrorString(r)));
  }
  // ncclInProgress until the communicator (or its last call) is done; an error then.
  absl::StatusOr<bool> Pending(const char* what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (comm_ == nullptr) return absl::CancelledError("nccl link: aborted");
    ncclResult_t state = ncclSuccess;
    api_->CommGetAsyncError(comm_, &state);
    if (state == ncclInProgress) return true;
    if (state != ncclSuccess) return Failed(state, what);
    return false;
  }
  template <typename F>
  absl::Status Run(F&& enqueue, const char* what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    absl::Status st = [&]() -> absl::Status {
      RETURN_IF_ERROR(CudaError(cudaSetDevice(device_), "cudaSetDevice"));
      RETURN_IF_ERROR(Wait([&] { return Pending("joining the communicator"); }, deadline));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (comm_ == nullptr) return absl::CancelledError("nccl link: aborted");
        const ncclResult_t r = enqueue();
        if (r != ncclSuccess && r != ncclInProgress) return Failed(r, what);
      }
      RETURN_IF_ERROR(Wait([&] { return Pending(what); }, deadline));
      RETURN_IF_ERROR(CudaError(cudaEventRecord(done_, stream_), "cudaEventRecord"));
      return Wait(
          [&]() -> absl::StatusOr<bool> {
            const cudaError_t e = cudaEventQuery(done_);
            if (e == cudaErrorNotReady) return Pending(what);
            RETURN_IF_ERROR(CudaError(e, what));
            return false;
          },
          deadline);
    }();
    if (!st.ok()) Abort();
    return st;
  }
  template <typename F>
  static absl::Status Wait(F&& pending, std::chrono::steady_clock::time_point deadline) {
    while (true) {
      ASSIGN_OR_RETURN(bool busy, pending());
      if (!busy) return absl::OkStatus();
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(
            "nccl link: the peer did not complete its side in time; the link was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  const NcclApi* const api_;
  const int peer_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  std::mutex mu_;  // comm_: Abort may come from another thread
  ncclComm_t comm_ = nullptr;
};

constexpr absl::string_view kOfferPrefix = "nccl:";

}  // namespace

absl::StatusOr<std::unique_ptr<PeerLink>> OpenNcclLink(std::string* offer) {
  ASSIGN_OR_RETURN(const NcclApi* api, Nccl());
  ncclUniqueId id;
  if (const ncclResult_t r = api->GetUniqueId(&id); r != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("nccl link: ncclGetUniqueId: ", api->GetErrorString(r)));
  }
  auto link = std::make_unique<NcclLink>(api, /*rank=*/0);
  RETURN_IF_ERROR(link->Init(id, 0));
  *offer = absl::StrCat(kOfferPrefix,
                        absl::BytesToHexString(absl::string_view(id.internal, sizeof(id))));
  return std::unique_ptr<PeerLink>(std::move(link));
}

absl::StatusOr<std::unique_ptr<PeerLink>> JoinNcclLink(const std::string& offer) {
  const std::string hex = offer.substr(std::min(offer.size(), kOfferPrefix.size()));
  if (!absl::StartsWith(offer, kOfferPrefix) || hex.size() != 2 * sizeof(ncclUniqueId) ||
      hex.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("not an NCCL link offer: expected 'nccl:' and ",
                                                   2 * sizeof(ncclUniqueId),
                                                   " lowercase hex digits"));
  }
  ASSIGN_OR_RETURN(const NcclApi* api, Nccl());
  ncclUniqueId id;
  const std::string bytes = absl::HexStringToBytes(hex);
  std::memcpy(id.internal, bytes.data(), sizeof(id));
  auto link = std::make_unique<NcclLink>(api, /*rank=*/1);
  RETURN_IF_ERROR(link->Init(id, 1));
  return std::unique_ptr<PeerLink>(std::move(link));
}

}  // namespace kvwire::kernels::cuda
