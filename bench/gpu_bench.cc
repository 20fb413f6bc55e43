// The engine on the GPU against the device's own ceilings, measured in the same run:
//
//   decode   tokens/s at each --batches size over caches of --ctx tokens, and the bytes one
//            step must read (every weight once, plus each sequence's K/V) per second, as a
//            fraction of a device-to-device copy's bytes (read + written) per second; each
//            step as one CUDA graph and op by op (--graphs), side by side;
//   prefill  tokens/s for each --prefill length, and its FLOP/s (2 per weight per token,
//            plus causal attention's 2·len²·heads·head_dim per layer) as a fraction of
//            cuBLAS's bf16 GEMM (8192³, float32 accumulation: the engine's own call); and the
//            same prefill compressing with SnapKV at --snapkv-budget, alternated with the plain
//            one, its time over the plain prefill's (the policy's whole cost: window scores,
//            votes, pooling, top-k, gathers and the kept rows' copies to the host); and one
//            layer's prefill attention alone, beside PyTorch's SDPA on the same shapes
//            (scripts/device_oracle.py, in the same device call).
//
// Medians of --runs. Needs a CUDA build on a machine with a GPU (scripts/device_run.sh).
// Run: gpu_bench [--model synthetic:llama-1b --batches 1,8,32 --ctx 512 --steps 32
//                 --prefill 2048,16384 --runs 3 --graphs on,off --snapkv-budget 1024]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/flags.h"
#include "common/compression/compression.h"
#include "common/compression/policy.h"
#include "common/engine/generate.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "common/model/llama_model.h"
#include "kernels/cuda_backend.h"

namespace kvwire {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::StatusOr<std::vector<int>> ParseList(const std::string& flag, const std::string& text, int lo,
                                           int hi) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not an integer in [", lo, ", ", hi, "]"));
    }
    out.push_back(v);
  }
  return out;
}

// `len` tokens of random K/V rows in every layer and head, as a prefill would leave them.
void Fill(KvCache& cache, int len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int l = 0; l < cache.num_layers(); ++l) {
    LayerCache& lc = cache.layer(l);
    std::vector<float> row(static_cast<size_t>(lc.head_dim) * len);
    for (int h = 0; h < lc.n_heads; ++h) {
      for (float& x : row) x = n(rng);
      FromFloat(lc.dtype, row.data(), lc.k_row(h, 0), row.size());
      for (float& x : row) x = n(rng);
      FromFloat(lc.dtype, row.data(), lc.v_row(h, 0), row.size());
      for (int t = 0; t < len; ++t) lc.positions[int64_t{h} * lc.capacity + t] = t;
    }
    lc.len = len;
  }
  cache.set_prompt_len(len);
}

// A compressor's layers, dropped (the bench measures producing them).
class DropLayers final : public CompressedLayerSink {
 public:
  absl::Status Accept(CompressedLayer) override { return absl::OkStatus(); }
};

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "gpu_bench: %s\n", std::string(st.message()).c_str());
  return 1;
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  using namespace kvwire;
  // Line by line into a log file too: a run cut off by a timeout keeps the lines it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Flags f;
  f.Define("model", "synthetic:llama-1b", "model (synthetic spec or folder)");
  f.Define("batches", "1,8,32", "decode batch sizes");
  f.Define("ctx", "512", "tokens in each decode sequence's cache");
  f.Define("steps", "32", "timed decode steps per run");
  f.Define("prefill", "2048,16384", "prefill prompt lengths (empty: none)");
  f.Define("runs", "3", "timed runs of each measurement (the median is reported)");
  f.Define("graphs", "on,off", "decode steps as CUDA graphs (on), op by op (off), or both");
  f.Define("snapkv-budget", "1024", "tokens SnapKV keeps per head in the compressing prefill");
  f.Define("projections", "on",
           "the decode projections alone through kvwire's GEMV and cuBLAS first (on|off)");
  if (int rc = ParseFlagsOrExit(f, "gpu_bench", "gpu_bench [flags]", argc, argv); rc >= 0) {
    return rc;
  }
  auto batches = ParseList("batches", f.GetString("batches"), 1, 4096);
  if (!batches.ok()) return Fail(batches.status());
  std::vector<int> prefills;
  if (!f.GetString("prefill").empty()) {
    auto p = ParseList("prefill", f.GetString("prefill"), 1, 1 << 20);
    if (!p.ok()) return Fail(p.status());
    prefills = *p;
  }
  auto ctx_or = f.GetInt("ctx", 1, 1 << 20), steps_or = f.GetInt("steps", 1, 100000),
       runs_or = f.GetInt("runs", 1, 1000);
  for (const auto* v : {&ctx_or, &steps_or, &runs_or}) {
    if (!v->ok()) return Fail(v->status());
  }
  auto budget_or = f.GetInt("snapkv-budget", 1, 1 << 20);
  if (!budget_or.ok()) return Fail(budget_or.status());
  const int ctx = static_cast<int>(*ctx_or), steps = static_cast<int>(*steps_or),
            runs = static_cast<int>(*runs_or);
  CompressionConfig snapkv;
  snapkv.policy = *MakePolicy("snapkv");
  snapkv.budget = static_cast<int>(*budget_or);
  const std::string projections_flag = f.GetString("projections");
  if (projections_flag != "on" && projections_flag != "off") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--projections: '", projections_flag, "' is neither on nor off")));
  }
  std::vector<bool> graph_modes;
  for (absl::string_view mode : absl::StrSplit(f.GetString("graphs"), ',')) {
    if (mode != "on" && mode != "off") {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--graphs: '", mode, "' is neither on nor off (a list: on,off)")));
    }
    graph_modes.push_back(mode == "on");
  }
  const int modes = static_cast<int>(graph_modes.size());
  // Tokens a decode cache takes: the context, then each mode's warm-up step and timed runs.
  const int decode_tokens = ctx + modes * (steps * runs + 1) + 4;
  auto name = kernels::CudaDeviceName();
  if (!name.ok()) return Fail(name.status());

  const auto copy = kernels::CudaCopyBandwidth(size_t{1} << 30);
  if (!copy.ok()) return Fail(copy.status());
  const auto gemm = kernels::CudaBf16GemmFlops(8192, 8192, 8192);
  if (!gemm.ok()) return Fail(gemm.status());

  LoadOptions lo;
  lo.backend = kernels::BackendKind::kCuda;
  int max_prefill = 0;
  for (int p : prefills) max_prefill = std::max(max_prefill, p);
  const int context = std::max(decode_tokens + 4, max_prefill + 8);
  std::string spec = f.GetString("model");
  if (spec.rfind("synthetic:", 0) == 0) spec += ",context=" + std::to_string(context);
  const Clock::time_point load0 = Clock::now();
  auto model_or = LlamaModel::Load(spec, lo);
  if (!model_or.ok()) return Fail(model_or.status());
  LlamaModel& m = **model_or;
  const ModelConfig& c = m.config();
  std::printf("device: %s\nmodel: %s (loaded and uploaded in %.1f s)\n", name->c_str(),
              m.description().c_str(), Seconds(load0, Clock::now()));
  std::printf(
      "ceilings: device-to-device copy %.0f GB/s (read + written); bf16 GEMM 8192^3 "
      "%.0f TFLOP/s\n\n",
      *copy / 1e9, *gemm / 1e12);

  // A decode step's projections alone, at this model's shapes in bf16: kvwire's GEMV beside
  // cuBLAS at each batch a GEMV serves, as bytes of W read per second against the copy. Which
  // is faster at each batch is what sets MatMul's switch between them (kernels/cuda/matmul.cu).
  if (projections_flag == "on") {
    constexpr int kGemvBatches[] = {1, 2, 4, 8, 16};
    std::printf("decode projections (bf16 W), GB/s of W read (of copy), kvwire GEMV | cuBLAS\n");
    const std::pair<const char*, std::pair<int, int>> projections[] = {
        {"q|k|v", {(c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size}},
        {"o", {c.hidden_size, c.num_heads * c.head_dim}},
        {"gate|up", {2 * c.intermediate_size, c.hidden_size}},
        {"down", {c.hidden_size, c.intermediate_size}},
        {"lm head", {c.vocab_size, c.hidden_size}}};
    std::printf("%-8s %7s %6s", "W", "n", "k");
    for (int bsz : kGemvBatches) std::printf("   %-27s", absl::StrCat("batch ", bsz).c_str());
    std::printf("\n");
    for (const auto& [what, shape] : projections) {
      std::printf("%-8s %7d %6d", what, shape.first, shape.second);
      for (int bsz : kGemvBatches) {
        const auto r = kernels::CudaDecodeMatMulRates(bsz, shape.first, shape.second);
        if (!r.ok()) return Fail(r.status());
        std::printf("   %5.0f (%.2f) | %5.0f (%.2f)", r->gemv / 1e9, r->gemv / *copy,
                    r->cublas / 1e9, r->cublas / *copy);
      }
      std::printf("\n");
    }
    std::printf("\n");
  }

  std::printf("decode, %d-token caches, %d steps, median of %d runs\n", ctx, steps, runs);
  std::printf("%6s %7s %10s %10s %12s %14s %10s\n", "batch", "graphs", "ms/step", "tokens/s",
              "MB/step", "GB/s read", "of copy");
  const int64_t kv_row = int64_t{2} * c.num_kv_heads * c.head_dim * DTypeSize(m.kv_dtype());
  for (int bsz : *batches) {
    // The caches in pages of a KV pool in device memory, as a decode node keeps them.
    const KvCacheShape shape{c.num_kv_heads, c.head_dim, m.kv_dtype(),
                             std::vector<int>(c.num_layers, decode_tokens)};
    const size_t page = size_t{64} << 10;
    auto pool =
        KvPool::OnBackend(m.backend(), bsz * (KvCache::PagedPages(shape, page) + 1) * page, page);
    if (!pool.ok()) return Fail(pool.status());
    std::vector<std::unique_ptr<KvCache>> caches;
    for (int b = 0; b < bsz; ++b) {
      auto host = KvCache::Create(shape, HeapKvAllocator());
      if (!host.ok()) return Fail(host.status());
      Fill(**host, ctx, 100 + b);
      auto cache = KvCache::CreatePaged(shape, **pool);
      if (!cache.ok()) return Fail(cache.status());
      if (absl::Status st = (*cache)->CopyFrom(**host); !st.ok()) return Fail(st);
      caches.push_back(std::move(*cache));
    }
    // Greedy tokens sampled on the device, as a decode node steps: the ids come back, not a
    // [batch, vocab] of logits (16 MB a step at batch 32 of a 128K vocabulary).
    const std::vector<kernels::SampleRow> rows(bsz);
    std::vector<kernels::SampledToken> tokens(bsz);
    auto step = [&](int s) {
      std::vector<DecodeInput> in;
      for (int b = 0; b < bsz; ++b) {
        in.push_back({static_cast<int32_t>(3 + (b * 131 + s * 17) % (c.vocab_size - 3)),
                      caches[b]->layer(0).len, caches[b].get(), nullptr});
      }
      return m.DecodeStepSampled(in, rows, tokens.data());  // returns once the ids are here
    };
    int next = 0;  // steps made, for the tokens
    for (bool graphs : graph_modes) {
      m.SetDecodeGraphs(graphs);
      const kernels::KernelBackend::GraphCounts g0 = m.backend()->graph_counts();
      if (absl::Status st = step(next++); !st.ok()) return Fail(st);  // a warm-up step
      // (seconds per step, bytes read per step) of each run; the caches grow between runs, so
      // the median run's own bytes go with its time.
      std::vector<std::pair<double, double>> per_run;
      for (int r = 0; r < runs; ++r) {
        int64_t kv_tokens = 0;
        const Clock::time_point t0 = Clock::now();
        for (int s = 0; s < steps; ++s) {
          for (auto& cache : caches) kv_tokens += cache->layer(0).len + 1;
          if (absl::Status st = step(next++); !st.ok()) return Fail(st);
        }
        per_run.emplace_back(Seconds(t0, Clock::now()) / steps,
                             static_cast<double>(m.WeightBytes()) +
                                 static_cast<double>(kv_tokens) / steps * c.num_layers * kv_row);
      }
      std::sort(per_run.begin(), per_run.end());
      const auto [t, bytes] = per_run[per_run.size() / 2];
      const kernels::KernelBackend::GraphCounts g = m.backend()->graph_counts();
      std::printf("%6d %7s %10.3f %10.0f %12.1f %14.0f %10.2f", bsz, graphs ? "on" : "off", t * 1e3,
                  bsz / t, bytes / 1e6, bytes / t / 1e9, bytes / t / *copy);
      // A graph that failed leaves the model stepping op by op, which the row would hide.
      if (graphs) {
        std::printf("   (graphs: %lld made, %lld updated, %lld run%s)",
                    static_cast<long long>(g.made - g0.made),
                    static_cast<long long>(g.updated - g0.updated),
                    static_cast<long long>(g.launched - g0.launched),
                    m.decode_graphs() ? "" : "; FAILED, stepping op by op");
      }
      std::printf("\n");
    }
  }

  if (!prefills.empty()) {
    std::printf("\nprefill, median of %d runs (after one warm-up)\n", runs);
    std::printf("%8s %10s %12s %12s %10s %12s %10s\n", "tokens", "ms", "tokens/s", "TFLOP/s",
                "of GEMM", "snapkv ms", "overhead");
  }
  // The projections of every layer (embedding, LM head and norms aside).
  const double h = c.hidden_size;
  const double linear_params =
      c.num_layers * (2.0 * h * c.num_heads * c.head_dim + 2.0 * h * c.num_kv_heads * c.head_dim +
                      3.0 * h * c.intermediate_size);
  for (int len : prefills) {
    std::vector<int32_t> ids(len);
    for (int i = 0; i < len; ++i) {
      ids[i] = static_cast<int32_t>(3 + (int64_t{i} * 7919) % (c.vocab_size - 3));
    }
    // Plain and compressing prefills alternated, after one warm-up of each.
    std::vector<double> secs, compressing;
    DropLayers drop;
    for (int r = 0; r <= runs; ++r) {
      const Clock::time_point t0 = Clock::now();
      auto res = m.Prefill(ids, nullptr);
      if (!res.ok()) return Fail(res.status());
      const Clock::time_point t1 = Clock::now();
      Compressor compressor(snapkv, c, m.kv_dtype(), &drop);
      auto kept = m.Prefill(ids, &compressor);
      if (!kept.ok()) return Fail(kept.status());
      if (r > 0) {
        secs.push_back(Seconds(t0, t1));
        compressing.push_back(Seconds(t1, Clock::now()));
      }
    }
    const double t = Median(secs);
    // Every linear layer once per token (the LM head for the last one), and causal
    // attention's QK and PV products over len²/2 pairs per query head.
    const double flops =
        2.0 * linear_params * len + 2.0 * c.vocab_size * c.hidden_size +
        2.0 * 2.0 * len * (len + 1) / 2.0 * c.num_heads * c.head_dim * c.num_layers;
    const double tc = Median(compressing);
    std::printf("%8d %10.1f %12.0f %12.1f %10.3f %12.1f %9.1f%%\n", len, t * 1e3, len / t,
                flops / t / 1e12, flops / t / *gemm, tc * 1e3, (tc / t - 1) * 100);
  }

  // One layer's prefill attention alone (causal, GQA, in the model's precision: FlashInfer for a
  // bf16 model), on the shapes scripts/device_oracle.py times PyTorch's SDPA on in the same
  // device call; FLOPs counted as the oracle counts them (half of QK and PV).
  if (!prefills.empty()) {
    std::printf("\nprefill attention alone, one layer (%d/%d heads x %d), median of %d runs\n",
                c.num_heads, c.num_kv_heads, c.head_dim, runs);
    std::printf("%8s %10s %12s\n", "tokens", "ms", "TFLOP/s");
  }
  kernels::KernelBackend& backend = *m.backend();
  for (int len : prefills) {
    const int d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
    const int64_t stride = qd + 2 * kvd;
    std::vector<float> host(static_cast<size_t>(len) * stride);
    std::mt19937_64 rng(7 + len);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (float& x : host) x = normal(rng);
    auto qkv = backend.Allocate(host.size() * sizeof(float));
    auto out = backend.Allocate(static_cast<size_t>(len) * qd * sizeof(float));
    if (!qkv.ok()) return Fail(qkv.status());
    if (!out.ok()) return Fail(out.status());
    if (absl::Status st = backend.CopyToDevice(*qkv, host.data(), host.size() * sizeof(float));
        !st.ok()) {
      return Fail(st);
    }
    const kernels::PrefillAttentionParams ap =
        m.PrefillAttentionOver(static_cast<const float*>(*qkv), static_cast<float*>(*out), len);
    std::vector<double> secs;
    for (int r = 0; r <= runs; ++r) {
      const Clock::time_point t0 = Clock::now();
      absl::Status st = backend.PrefillAttention(ap);
      if (st.ok()) st = backend.Synchronize();
      if (!st.ok()) return Fail(st);
      if (r > 0) secs.push_back(Seconds(t0, Clock::now()));
    }
    const double t = Median(secs);
    const double flops = 2.0 * 2.0 * c.num_heads * d * static_cast<double>(len) * len / 2.0;
    std::printf("%8d %10.3f %12.1f\n", len, t * 1e3, flops / t / 1e12);
    backend.Free(*qkv);
    backend.Free(*out);
  }
  return 0;
}
