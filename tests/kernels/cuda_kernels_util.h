// Which attention and top-k kernels the CUDA backend runs in this build and process, for the tests
// that check a call went where it should (backend_ops_test.cc, coded_cache_test.cc). Kept apart
// from ops_test_util.h: CUDA's headers come with it, which the kernel emulation must not see.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#if KVWIRE_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_decode.h"
#include "kernels/cuda/flashinfer_topk.h"
#endif

namespace kvwire::kernels {

// Whether this build has FlashInfer's kernels (CMake found its headers).
inline bool FlashInferBuilt() {
#if KVWIRE_HAVE_FLASHINFER
  return true;
#else
  return false;
#endif
}
// Calls that went through FlashInfer's batch decode so far (0 in a build without it).
inline int64_t FlashInferDecodeLaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::FlashInferDecodeLaunches();
#else
  return 0;
#endif
}
// Calls that went through FlashInfer's top-k so far (0 in a build without it).
inline int64_t FlashInferTopKLaunchesHere() {
#if KVWIRE_HAVE_FLASHINFER
  return cuda::FlashInferTopKLaunches();
#else
  return 0;
#endif
}
// Whether the CUDA backend ranks the TopK calls FlashInfer's top-k serves there: built, on a
// device with the shared memory it takes, and not sent to CUB by $KVWIRE_CUDA_TOPK=cub.
inline bool CudaRanksThroughFlashInfer() {
#if KVWIRE_HAVE_FLASHINFER
  const char* env = std::getenv("KVWIRE_CUDA_TOPK");
  return cuda::FlashInferTopKAvailable() && (env == nullptr || std::string(env) != "cub");
#else
  return false;
#endif
}
// $KVWIRE_CUDA_ATTENTION, or "" where it is unset.
inline std::string CudaAttentionChoice() {
  const char* env = std::getenv("KVWIRE_CUDA_ATTENTION");
  return env == nullptr ? "" : env;
}

}  // namespace kvwire::kernels
