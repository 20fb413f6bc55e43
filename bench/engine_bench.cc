// Engine throughput beside the machine's memory bandwidth, measured in one run:
//
//   StreamCopy / StreamRead   STREAM-style bandwidth with the engine's thread count
//   MatMulBf16/<m>/<n>/<k>    the CPU backend's y = x·Wᵀ with bf16 W: FLOP/s (2·m·n·k per
//                             product), the work a prefill is bound by
//   Prefill/<model>/<len>     prompt tokens per second
//   Decode/<model>/<ctx>      tokens per second at batch 1 with a ctx-token cache, and the
//                             bandwidth decode achieves: (weight bytes + KV bytes read) / step
//
// Models: the real stories260K (when ../shared is present) and synthetic:llama-1b
// (16 layers, hidden 2048, 32/8 heads, bf16). Run: build/bench/engine_bench
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/base/host_alloc.h"
#include "common/base/status.h"
#include "common/engine/generate.h"
#include "common/model/llama_model.h"
#include "kernels/backend.h"
#include "kernels/simd.h"  // immintrin.h
#include "kernels/thread_pool.h"

namespace kvwire {
namespace {

constexpr int kThreads = 2;

std::string StoriesDir() {
#ifdef KVWIRE_SOURCE_DIR
  return std::string(KVWIRE_SOURCE_DIR) + "/../shared/models/stories260K-hf";
#else
  return "../shared/models/stories260K-hf";
#endif
}

LlamaModel* GetModel(const std::string& spec) {
  static std::map<std::string, std::unique_ptr<LlamaModel>>* models =
      new std::map<std::string, std::unique_ptr<LlamaModel>>();
  auto it = models->find(spec);
  if (it != models->end()) return it->second.get();
  LoadOptions options;
  options.threads = kThreads;
  auto m = LlamaModel::Load(spec == "stories" ? StoriesDir() : spec, options);
  if (!m.ok()) return nullptr;
  return (*models)[spec] = std::move(*m), (*models)[spec].get();
}

// n floats of `value`, on huge pages as the engine's weights are (common/base/host_alloc.h):
// the bandwidth figures below are the ceilings of the engine's own reads.
struct FreeHost {
  void operator()(float* p) const { std::free(p); }
};
std::unique_ptr<float[], FreeHost> HostFloats(size_t n, float value) {
  std::unique_ptr<float[], FreeHost> p(
      reinterpret_cast<float*>(AllocateHostBytes(n * sizeof(float))));
  KVWIRE_CHECK(p != nullptr);
  std::fill(p.get(), p.get() + n, value);
  return p;
}

// STREAM "copy": a[i] = b[i] over arrays far larger than the caches; bytes counted as
// read + written, as STREAM does.
void BM_StreamCopy(benchmark::State& state) {
  const size_t n = size_t{1} << 27;  // 512 MiB per array
  auto a = HostFloats(n, 1.f), b = HostFloats(n, 2.f);
  kernels::ThreadPool pool(kThreads);
  for (auto _ : state) {
    pool.ParallelFor(static_cast<int64_t>(n), 1 << 20, [&](int64_t lo, int64_t hi) {
      std::memcpy(a.get() + lo, b.get() + lo, (hi - lo) * sizeof(float));
    });
    benchmark::DoNotOptimize(a.get());
  }
  state.SetBytesProcessed(state.iterations() * int64_t(2 * n * sizeof(float)));
}
BENCHMARK(BM_StreamCopy)->Unit(benchmark::kMillisecond)->UseRealTime();

// Σ x[0, n): eight independent vector accumulators, so the loop is bound by how fast memory
// delivers lines, not by the latency of one chain of adds (an independent read kernel in the
// manner of STREAM's, not the engine's own code).
float SumRange(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc[8];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (; i + 128 <= n; i += 128) {
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(x + i + 16 * j));
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm512_add_ps(acc[0], acc[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc[0]);
  for (float v : lanes) total += v;
#elif defined(__AVX2__)
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (; i + 64 <= n; i += 64) {
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(x + i + 8 * j));
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0]);
  for (float v : lanes) total += v;
#endif
  for (; i < n; ++i) total += x[i];
  return total;
}

// Read-only bandwidth (a sum), the access pattern of decode.
void BM_StreamRead(benchmark::State& state) {
  const size_t n = size_t{1} << 28;  // 1 GiB
  auto a = HostFloats(n, 1.f);
  kernels::ThreadPool pool(kThreads);
  std::vector<float> partial(64);
  for (auto _ : state) {
    pool.ParallelFor(static_cast<int64_t>(n), 1 << 22, [&](int64_t lo, int64_t hi) {
      partial[(lo >> 22) % 64] = SumRange(a.get() + lo, hi - lo);
    });
    benchmark::DoNotOptimize(partial.data());
  }
  state.SetBytesProcessed(state.iterations() * int64_t(n * sizeof(float)));
}
BENCHMARK(BM_StreamRead)->Unit(benchmark::kMillisecond)->UseRealTime();

// The 1B model's products at a prefill of m tokens: attention's (n 2048, k 2048), the MLP's up
// projections (n 8192, k 2048) and its down projection (n 2048, k 8192).
void BM_MatMulBf16(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0));
  const int n = static_cast<int>(state.range(1));
  const int k = static_cast<int>(state.range(2));
  auto backend = kernels::MakeBackend(kernels::BackendKind::kCpu, kThreads);
  if (!backend.ok()) {
    state.SkipWithError(std::string(backend.status().message()).c_str());
    return;
  }
  std::vector<float> x(static_cast<size_t>(m) * k), y(static_cast<size_t>(m) * n);
  std::vector<uint16_t> w(static_cast<size_t>(n) * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) / 17.f - 0.5f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = FloatToBf16(static_cast<float>(i % 13) / 13.f);
  kernels::MatMulParams p;
  p.x = x.data();
  p.w = w.data();
  p.w_dtype = DType::kBF16;
  p.y = y.data();
  p.m = m;
  p.n = n;
  p.k = k;
  for (auto _ : state) {
    const absl::Status st = (*backend)->MatMul(p);
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * m * n * k * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_MatMulBf16)
    ->Args({512, 2048, 2048})
    ->Args({512, 8192, 2048})
    ->Args({512, 2048, 8192})
    ->Args({16, 8192, 2048})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Prefill(benchmark::State& state, const std::string& spec) {
  LlamaModel* m = GetModel(spec);
  if (m == nullptr) {
    state.SkipWithError(("cannot load " + spec).c_str());
    return;
  }
  const int len = static_cast<int>(state.range(0));
  std::vector<int32_t> ids(len);
  for (int i = 0; i < len; ++i) ids[i] = 3 + (i * 31) % (m->config().vocab_size - 3);
  for (auto _ : state) {
    auto r = m->Prefill(ids, nullptr);
    benchmark::DoNotOptimize(r);
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(len) * state.iterations(),
                                                  benchmark::Counter::kIsRate);
}

void BM_Decode(benchmark::State& state, const std::string& spec) {
  LlamaModel* m = GetModel(spec);
  if (m == nullptr) {
    state.SkipWithError(("cannot load " + spec).c_str());
    return;
  }
  const ModelConfig& c = m->config();
  const int ctx = static_cast<int>(state.range(0));
  // Fill the cache synthetically: decode cost depends on its length, not its contents.
  KvCacheShape shape{c.num_kv_heads, c.head_dim, m->kv_dtype(),
                     std::vector<int>(c.num_layers, ctx + 1)};
  auto cache = KvCache::Create(shape, HeapKvAllocator());
  if (!cache.ok()) {
    state.SkipWithError("cannot allocate the cache");
    return;
  }
  std::vector<float> logits(c.vocab_size);
  int64_t kv_bytes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    for (int l = 0; l < c.num_layers; ++l) (*cache)->layer(l).len = ctx;
    state.ResumeTiming();
    DecodeInput in{5, ctx, cache->get(), nullptr};
    auto st = m->DecodeStep({&in, 1}, logits.data());
    if (!st.ok()) state.SkipWithError(std::string(st.message()).c_str());
    kv_bytes = (*cache)->StoredBytes();
  }
  const double bytes = static_cast<double>(m->WeightBytes() + kv_bytes);
  state.counters["tokens/s"] = benchmark::Counter(state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes/token"] = bytes;
  state.counters["bandwidth"] = benchmark::Counter(
      bytes * state.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

BENCHMARK_CAPTURE(BM_Prefill, stories, std::string("stories"))
    ->Arg(16)
    ->Arg(256)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Decode, stories, std::string("stories"))
    ->Arg(16)
    ->Arg(500)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Prefill, llama_1b, std::string("synthetic:llama-1b"))
    ->Arg(16)
    ->Arg(128)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);
BENCHMARK_CAPTURE(BM_Decode, llama_1b, std::string("synthetic:llama-1b"))
    ->Arg(16)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

}  // namespace
}  // namespace kvwire

BENCHMARK_MAIN();
