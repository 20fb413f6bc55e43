// Why /metrics is served by common/telemetry/metrics_http.cc and not by prometheus-cpp's own
// exposer: Debian's civetweb (under prometheus::Exposer) starts its worker threads with a
// fixed 100 KiB stack, and glibc places the process's static TLS on every thread's stack,
// refusing (EINVAL) a stack that cannot hold it. This test links what the node binaries
// link (the kernels: OpenBLAS, and cuBLAS/cuBLASLt in CUDA builds), measures that static TLS,
// and checks the exposer fails exactly when it does not fit. If it starts where it should
// not, civetweb changed: serve /metrics with the exposer and delete metrics_http.
#include <gtest/gtest.h>
#include <link.h>
#include <prometheus/exposer.h>

#include <exception>
#include <string>

#include "kernels/backend.h"

namespace kvwire {
namespace {

// Debian's civetweb: pthread_attr_setstacksize(0x19000) for every worker thread.
constexpr size_t kCivetwebWorkerStack = 0x19000;
// What glibc needs beside the TLS: a guard page, its minimal usable stack (16 KiB), the
// thread control block.
constexpr size_t kGlibcOverhead = 4096 + 16384 + 2048;

// The static TLS of this process: every PT_TLS segment of the objects loaded at startup.
size_t StaticTlsBytes() {
  size_t total = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          if (info->dlpi_phdr[i].p_type == PT_TLS) {
            *static_cast<size_t*>(data) += info->dlpi_phdr[i].p_memsz;
          }
        }
        return 0;
      },
      &total);
  return total;
}

TEST(PrometheusExposer, StartsOnlyWhereTheStaticTlsFitsCivetwebsStack) {
  // The kernels, as the nodes use them (OpenBLAS; the CUDA libraries come with the backend).
  ASSERT_TRUE(kernels::MakeBackend(kernels::BackendKind::kCpu).ok());
  const size_t tls = StaticTlsBytes();
  std::string error;
  bool started = false;
  try {
    prometheus::Exposer exposer("127.0.0.1:0", 2);
    started = true;
  } catch (const std::exception& e) {
    error = e.what();
  }
  const size_t need = tls + kGlibcOverhead;
  if (need > kCivetwebWorkerStack + 4096) {
    EXPECT_FALSE(started) << "prometheus::Exposer now starts with " << tls
                          << " bytes of static TLS: serve /metrics with it, delete metrics_http";
    EXPECT_NE(error.find("null context"), std::string::npos) << error;
  } else if (need + 4096 < kCivetwebWorkerStack) {
    EXPECT_TRUE(started) << "with " << tls << " bytes of static TLS: " << error;
  } else {
    GTEST_SKIP() << tls << " bytes of static TLS: too close to civetweb's stack to tell";
  }
  std::printf(
      "static TLS %zu bytes (+%zu for glibc) vs civetweb's %zu-byte worker stack: the "
      "exposer %s\n",
      tls, kGlibcOverhead, kCivetwebWorkerStack, started ? "starts" : "cannot start");
}

}  // namespace
}  // namespace kvwire
