// PeerLink over NCCL (kernels/backend.h), for the cuda backend: a communicator of two ranks,
// the opener rank 0 and the joiner rank 1, its ncclUniqueId the offer ("nccl:" and 256 hex
// digits). NCCL is loaded when first used (dlopen of $KVWIRE_NCCL_LIBRARY, else libnccl.so.2),
// as PyTorch and vLLM's pynccl do: the library is hundreds of MB and only this transport needs
// it, so a node that does not use it runs without it.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvwire::kernels::cuda {

absl::StatusOr<std::unique_ptr<PeerLink>> OpenNcclLink(std::string* offer);
absl::StatusOr<std::unique_ptr<PeerLink>> JoinNcclLink(const std::string& offer);

}  // namespace kvwire::kernels::cuda
