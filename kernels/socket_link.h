// PeerLink (kernels/backend.h) over a loopback TCP socket, moving a backend's memory through
// host buffers (CopyToHost, CopyToDevice): the guarded backend's stand-in for NCCL, so that the
// nccl KV transport's whole protocol (offers on the Prefill stream, ordered sends, timeouts,
// aborts) runs and is tested on a host without GPUs, in one process or between two. The offer
// is "socket-link:PORT:SECRET": the opener listens on 127.0.0.1:PORT and takes the first
// connection that presents SECRET (128 random bits, hex). Each send is framed with its length,
// so a receive of another size fails (where NCCL would mix the bytes up).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace kvwire::kernels {

absl::StatusOr<std::unique_ptr<PeerLink>> OpenSocketLink(KernelBackend* backend,
                                                         std::string* offer);
absl::StatusOr<std::unique_ptr<PeerLink>> JoinSocketLink(KernelBackend* backend,
                                                         const std::string& offer);

// For tests: every receive on a socket link in this process waits this long first, as over a
// slow fabric, so that a sender runs ahead of its receiver (0, the default: none).
void SetSocketLinkReceiveDelay(std::chrono::milliseconds delay);

}  // namespace kvwire::kernels
