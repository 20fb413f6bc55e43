// Long-context decode: time per step and K/V bytes read per step for each decode
// configuration, measured side by side (round-robin over the modes, one step each per
// round, medians reported) on a model shaped so attention matters (synthetic:attn-8kv: 32
// query heads, 8 KV heads x 128, bf16, small MLP). The cache is filled synthetically with
// `--ctx` tokens, as a long prefill would leave it.
//
// Two tables: the whole step (which also streams every weight, the same for every mode), and
// its attention part alone, timed inside the step (DecodeTimes: the sparse selection plus
// the attention kernel, over the layers), whose speed-up over full dense attention is set
// against the reduction in K/V bytes read.
//
//   full dense        every prompt token, exact attention
//   compressed dense  --kept tokens per KV head (what SnapKV-family prefill keeps), exact
//   hybrid            the full cache, RocketKV stage 2 reading --t tokens' worth per step
//   rocketkv          both stages from --t: SnapKV++ capacity by the α rule, then hybrid
//   quest             the full cache, Quest pages at --t
//
// `--batch` decodes that many sequences per step (each its own cache and selector, the same
// rows), and `--backend cuda` runs it on a GPU (selection and attention on the device; KV bytes
// then count the whole batch). On a device each round makes two steps per mode: one as the
// decode engine makes it (a CUDA graph), timed whole, and one timed inside (op by op: the
// timing waits for the device between the parts), for the attention table. `--kv-formats fp8,int4`
// adds the dense modes over caches kept in those formats (the wire's codes, dequantised as
// attention reads them), and `--kv-sparse` the sparse modes over them too.
//
// Run: build/bench/decode_bench [--ctx 16384 --kept 2048 --t 1024 --steps 24 --threads 2
//                                --batch 1 --backend cpu --kv-formats fp8,int4 --kv-sparse]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/flags.h"
#include "common/base/kv_format.h"
#include "common/base/status.h"
#include "common/model/kv_cache.h"
#include "common/model/kv_pool.h"
#include "common/model/llama_model.h"
#include "common/sparse/attention.h"
#include "common/sparse/rocketkv.h"

namespace kvwire {
namespace {

struct Mode {
  std::string name;
  int prompt_kept;                    // tokens per KV head in the cache before decoding
  KvFormat format = KvFormat::kAuto;  // how the cache keeps its rows
  DecodeAttentionConfig attention;
  std::vector<std::unique_ptr<KvCache>> caches;  // one per sequence of the batch
  std::vector<std::unique_ptr<DecodeSelector>> selectors;
  std::vector<double> ms, attn_ms, sel_ms;
  kernels::KernelBackend::CopyCounts copies;  // summed over the timed steps
};

void Fill(KvCache& cache, int len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  for (int l = 0; l < cache.num_layers(); ++l) {
    LayerCache& lc = cache.layer(l);
    std::vector<float> row(lc.head_dim);
    for (int h = 0; h < lc.n_heads; ++h) {
      for (int t = 0; t < len; ++t) {
        for (float& x : row) x = n(rng);
        FromFloat(lc.dtype, row.data(), lc.k_row(h, t), lc.head_dim);
        for (float& x : row) x = n(rng);
        FromFloat(lc.dtype, row.data(), lc.v_row(h, t), lc.head_dim);
        lc.positions[int64_t{h} * lc.capacity + t] = t;
      }
    }
    lc.len = len;
  }
}

// The rows of `host` (a cache in its dtype) coded in `format` as the wire delivers them: a block
// per layer and head ([layer · n_heads + head]), coded once for every sequence of the batch.
struct CodedBlocks {
  std::vector<std::vector<uint8_t>> k, v;
};
CodedBlocks EncodeBlocks(const KvCache& host, KvFormat format) {
  CodedBlocks blocks;
  for (int l = 0; l < host.num_layers(); ++l) {
    const LayerCache& from = host.layer(l);
    const int n = from.len;
    for (int h = 0; h < from.n_heads; ++h) {
      blocks.k.emplace_back(KvKeyBlockBytes(format, from.dtype, from.head_dim, n, 0, n));
      blocks.v.emplace_back(KvValueBlockBytes(format, from.dtype, from.head_dim, n, 0, n));
      EncodeKvKeys(format, from.dtype, from.head_dim, n, 0, n, from.k_row(h, 0),
                   blocks.k.back().data());
      EncodeKvValues(format, from.dtype, from.head_dim, n, 0, n, from.v_row(h, 0),
                     blocks.v.back().data());
    }
  }
  return blocks;
}

// A coded cache holding `host`'s rows, from their blocks.
absl::Status FillCoded(KvCache& cache, const KvCache& host, const CodedBlocks& blocks) {
  for (int l = 0; l < cache.num_layers(); ++l) {
    const LayerCache& from = host.layer(l);
    LayerCache& lc = cache.layer(l);
    const int n = from.len;
    lc.coding.kept = n;
    for (int h = 0; h < lc.n_heads; ++h) {
      const size_t i = static_cast<size_t>(l) * lc.n_heads + h;
      RETURN_IF_ERROR(cache.WriteCodedBlock(l, h, 0, n, blocks.k[i].data(), blocks.v[i].data()));
      std::copy_n(from.positions + int64_t{h} * from.capacity, n,
                  lc.positions + int64_t{h} * lc.capacity);
    }
    lc.len = n;
  }
  cache.set_prompt_len(host.prompt_len());
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvwire

int main(int argc, char** argv) {
  using namespace kvwire;
  // Line by line into a log file too: a run cut off by a timeout keeps the lines it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Flags f;
  f.Define("model", "synthetic:attn-8kv", "model (synthetic spec or folder)");
  f.Define("ctx", "16384", "prompt tokens in the cache");
  f.Define("kept", "2048", "tokens per KV head the compressed cache keeps");
  f.Define("t", "1024", "per-step token budget of the sparse modes");
  f.Define("steps", "24", "timed decode steps per mode");
  f.Define("threads", "2", "CPU threads");
  f.Define("batch", "1", "sequences decoded together in each step (each with its own cache)");
  f.Define("backend", "cpu", "kernel backend: cpu, reference, cuda or guarded");
  f.Define("kv-formats", "",
           "coded KV formats (fp8, int8, int4) whose full and compressed dense caches to add");
  f.DefineBool("kv-sparse", "with --kv-formats: the sparse modes over those formats too");
  if (int rc = ParseFlagsOrExit(f, "decode_bench", "decode_bench [flags]", argc, argv); rc >= 0) {
    return rc;
  }
  if (f.GetBool("kv-sparse") && f.GetString("kv-formats").empty()) {
    std::fprintf(
        stderr,
        "decode_bench: --kv-sparse adds sparse modes over --kv-formats; give those formats\n");
    return 2;
  }
  auto ctx_or = f.GetInt("ctx", 16, 1 << 20), kept_or = f.GetInt("kept", 16, 1 << 20),
       t_or = f.GetInt("t", 2, 1 << 20), steps_or = f.GetInt("steps", 1, 10000),
       threads_or = f.GetInt("threads", 1, 256), batch_or = f.GetInt("batch", 1, 1024);
  for (const auto* v : {&ctx_or, &kept_or, &t_or, &steps_or, &threads_or, &batch_or}) {
    if (!v->ok()) {
      std::fprintf(stderr, "decode_bench: %s\n", std::string(v->status().message()).c_str());
      return 2;
    }
  }
  const int ctx = static_cast<int>(*ctx_or), kept = static_cast<int>(*kept_or);
  const int t = static_cast<int>(*t_or), steps = static_cast<int>(*steps_or);
  const int batch = static_cast<int>(*batch_or);
  LoadOptions lo;
  lo.threads = static_cast<int>(*threads_or);
  auto backend = kernels::ParseBackendKind(f.GetString("backend"));
  if (!backend.ok()) {
    std::fprintf(stderr, "decode_bench: --backend: %s\n",
                 std::string(backend.status().message()).c_str());
    return 2;
  }
  lo.backend = *backend;
  auto model_or = LlamaModel::Load(
      f.GetString("model") + ",context=" + std::to_string(ctx + 2 * steps + 8), lo);
  if (!model_or.ok()) {
    std::fprintf(stderr, "%s\n", std::string(model_or.status().message()).c_str());
    return 1;
  }
  LlamaModel& m = **model_or;
  const ModelConfig& c = m.config();
  // Steps per mode and round: the whole step as a graph, then one timed inside (see above).
  const int passes = m.on_device() && m.decode_graphs() ? 2 : 1;
  const int generated = passes * steps;  // tokens each cache takes
  std::printf(
      "model: %s\ncontext %d tokens, compressed cache %d, token budget t=%d, %d steps, batch %d, "
      "%s backend, %d threads\n",
      m.description().c_str(), ctx, kept, t, steps, batch,
      std::string(kernels::BackendName(lo.backend)).c_str(), lo.threads);

  // The pool (on a device) outlives the modes' caches, which return their pages to it.
  std::unique_ptr<KvPool> pool;
  std::vector<Mode> modes;
  auto add = [&](std::string name, int prompt_kept, DecodeAttentionConfig a,
                 KvFormat format = KvFormat::kAuto) {
    Mode md;
    md.name = std::move(name);
    md.prompt_kept = prompt_kept;
    md.attention = a;
    md.format = format;
    modes.push_back(std::move(md));
  };
  DecodeAttentionConfig dense;
  add("full dense", ctx, dense);
  add("compressed dense", kept, dense);
  DecodeAttentionConfig hybrid;
  hybrid.mode = AttentionMode::kHybrid;
  hybrid.token_budget = t;
  add("hybrid (full cache)", ctx, hybrid);
  auto two = ResolveRocketKV(t, ctx, generated + 1, c.head_dim, CompressionConfig{});
  if (!two.ok()) {
    std::fprintf(stderr, "decode_bench: rocketkv: %s\n",
                 std::string(two.status().message()).c_str());
    return 1;
  }
  add("rocketkv (2 stages)", two->stage1.budget, two->stage2);
  DecodeAttentionConfig quest;
  quest.mode = AttentionMode::kQuest;
  quest.token_budget = t;
  add("quest (full cache)", ctx, quest);
  for (absl::string_view name : absl::StrSplit(f.GetString("kv-formats"), ',', absl::SkipEmpty())) {
    auto format = ParseKvFormat(name);
    if (!format.ok() || !KvCoded(*format)) {
      std::fprintf(stderr, "decode_bench: --kv-formats: '%s': coded caches are fp8, int8 or int4\n",
                   std::string(name).c_str());
      return 2;
    }
    if (absl::Status st = CheckKvFormat(*format, c.head_dim); !st.ok()) {
      std::fprintf(stderr, "decode_bench: --kv-formats: %s\n", std::string(st.message()).c_str());
      return 2;
    }
    add(absl::StrCat("full dense ", name), ctx, dense, *format);
    add(absl::StrCat("compressed dense ", name), kept, dense, *format);
    if (f.GetBool("kv-sparse")) {
      add(absl::StrCat("hybrid ", name), ctx, hybrid, *format);
      add(absl::StrCat("rocketkv ", name), two->stage1.budget, two->stage2, *format);
      add(absl::StrCat("quest ", name), ctx, quest, *format);
    }
  }

  // On a device the caches and their selectors' state are pages of one KV pool in its memory,
  // as on a decode node (KvPool::OnBackend); on the host, heap memory.
  if (m.on_device()) {
    size_t bytes = 0;
    const size_t page = size_t{64} << 10;
    for (const Mode& md : modes) {
      KvCacheShape shape{c.num_kv_heads, c.head_dim, m.kv_dtype(),
                         std::vector<int>(c.num_layers, md.prompt_kept + generated + 2)};
      auto sel = DecodeSelectorBytes(md.attention, c, shape);
      shape.format = md.format;
      shape.appended = generated + 2;
      bytes += batch * (KvCache::PagedPages(shape, page) * page + (sel.ok() ? *sel : 0) + page);
    }
    auto made = KvPool::OnBackend(m.backend(), bytes + (size_t{64} << 20), page);
    if (!made.ok()) {
      std::fprintf(stderr, "%s\n", std::string(made.status().message()).c_str());
      return 1;
    }
    pool = std::move(*made);
  }
  KvAllocator& memory = pool ? static_cast<KvAllocator&>(*pool) : HeapKvAllocator();
  for (size_t i = 0; i < modes.size(); ++i) {
    Mode& md = modes[i];
    KvCacheShape shape{c.num_kv_heads, c.head_dim, m.kv_dtype(),
                       std::vector<int>(c.num_layers, md.prompt_kept + generated + 2)};
    // Every sequence of the batch holds the same rows (filled once on the host, copied).
    auto host = KvCache::Create(shape, HeapKvAllocator());
    shape.format = md.format;
    shape.appended = generated + 2;
    if (!host.ok()) {
      std::fprintf(stderr, "%s: %s\n", md.name.c_str(),
                   std::string(host.status().message()).c_str());
      return 1;
    }
    (*host)->set_prompt_len(ctx);
    Fill(**host, md.prompt_kept, 42 + i);
    const CodedBlocks blocks =
        md.format == KvFormat::kAuto ? CodedBlocks{} : EncodeBlocks(**host, md.format);
    for (int b = 0; b < batch; ++b) {
      auto cache = pool ? KvCache::CreatePaged(shape, *pool) : KvCache::Create(shape, memory);
      if (!cache.ok()) {
        std::fprintf(stderr, "%s: %s\n", md.name.c_str(),
                     std::string(cache.status().message()).c_str());
        return 1;
      }
      if (absl::Status st = md.format == KvFormat::kAuto ? (*cache)->CopyFrom(**host)
                                                         : FillCoded(**cache, **host, blocks);
          !st.ok()) {
        std::fprintf(stderr, "%s: %s\n", md.name.c_str(), std::string(st.message()).c_str());
        return 1;
      }
      md.caches.push_back(std::move(*cache));
      auto sel = MakeDecodeSelector(md.attention, c, shape, memory);
      if (!sel.ok()) {
        std::fprintf(stderr, "%s: %s\n", md.name.c_str(),
                     std::string(sel.status().message()).c_str());
        return 1;
      }
      md.selectors.push_back(std::move(*sel));
    }
    // One untimed step builds the page summaries over the prompt (done once per request).
    std::vector<float> logits(static_cast<size_t>(batch) * c.vocab_size);
    std::vector<DecodeInput> in;
    for (int b = 0; b < batch; ++b) {
      in.push_back({5, ctx, md.caches[b].get(), md.selectors[b].get()});
    }
    if (absl::Status st = m.DecodeStep(in, logits.data()); !st.ok()) {
      std::fprintf(stderr, "%s: %s\n", md.name.c_str(), std::string(st.message()).c_str());
      return 1;
    }
  }
  // Each step as the decode engine runs it: greedy tokens sampled on the model's backend.
  const std::vector<kernels::SampleRow> rows(batch);
  std::vector<kernels::SampledToken> tokens(batch);
  for (int s = 0; s < steps; ++s) {
    for (Mode& md : modes) {
      for (int pass = 0; pass < passes; ++pass) {
        // The whole step from the first pass; the parts from the last (the only one on a host).
        const bool whole = pass == 0, parts = pass == passes - 1;
        std::vector<DecodeInput> in;
        for (int b = 0; b < batch; ++b) {
          in.push_back({7, ctx + 1 + s * passes + pass, md.caches[b].get(), md.selectors[b].get()});
        }
        DecodeTimes times;
        const kernels::KernelBackend::CopyCounts before = m.copy_counts();
        const auto t0 = std::chrono::steady_clock::now();
        if (absl::Status st =
                m.DecodeStepSampled(in, rows, tokens.data(), parts ? &times : nullptr);
            !st.ok()) {
          std::fprintf(stderr, "%s: %s\n", md.name.c_str(), std::string(st.message()).c_str());
          return 1;
        }
        if (whole) {
          md.ms.push_back(
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count());
          const kernels::KernelBackend::CopyCounts step = m.copy_counts() - before;
          md.copies.to_host_bytes += step.to_host_bytes;
          md.copies.to_host_calls += step.to_host_calls;
          md.copies.to_device_bytes += step.to_device_bytes;
          md.copies.to_device_calls += step.to_device_calls;
        }
        if (parts) {
          md.attn_ms.push_back(1e3 * (times.selection_s + times.attention_s));
          md.sel_ms.push_back(1e3 * times.selection_s);
        }
      }
    }
  }
  const double weights = static_cast<double>(m.WeightBytes());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("\nwhole step%s\n%-22s %9s %10s %12s %10s %9s %9s  %s\n",
              passes == 2 ? " (each a CUDA graph, as the decode engine steps)" : "", "mode",
              "kv_tokens", "step_ms", "kv_MB/step", "GB/s", "x_faster", "x_less_kv", "parameters");
  double base_ms = 0, base_kv = 0, base_attn = 0;
  std::vector<double> kv_of;
  for (Mode& md : modes) {
    const double med = median(md.ms);
    const int len = md.caches[0]->layer(0).len;
    auto p = ResolveSparseParams(md.attention, md.prompt_kept + generated + 2, c.head_dim);
    // Over a coded cache: its codes, the parameters they need and its residual's rows.
    const double kv = static_cast<double>(BytesReadPerStep(*p, md.caches[0]->layer(0))) *
                      c.num_kv_heads * c.num_layers * batch;
    kv_of.push_back(kv);
    if (base_ms == 0) {
      base_ms = med;
      base_kv = kv;
      base_attn = median(md.attn_ms);
    }
    std::printf("%-22s %9d %10.2f %12.2f %10.2f %9.2f %9.2f  %s\n", md.name.c_str(), len, med,
                kv / 1e6, (kv + weights) / (med * 1e6), base_ms / med, base_kv / kv,
                md.attention.mode == AttentionMode::kDense
                    ? "dense"
                    : absl::StrCat(md.attention.Describe(), " -> k=", p->top_k, " r=", p->top_r,
                                   " page=", p->page_size)
                          .c_str());
  }
  // The attention part of the same steps: what sparse attention can speed up. `of_kv` is
  // the speed-up as a fraction of the reduction in K/V bytes (1: as fast as the bytes allow).
  std::printf("\nattention part of the step (selection + attention kernel, all layers)\n");
  std::printf("%-22s %9s %9s %12s %10s %9s %9s %7s\n", "mode", "attn_ms", "select_ms", "kv_MB/step",
              "GB/s", "x_faster", "x_less_kv", "of_kv");
  for (size_t i = 0; i < modes.size(); ++i) {
    const double attn = median(modes[i].attn_ms), kv = kv_of[i];
    std::printf("%-22s %9.3f %9.3f %12.2f %10.2f %9.2f %9.2f %7.2f\n", modes[i].name.c_str(), attn,
                median(modes[i].sel_ms), kv / 1e6, kv / (attn * 1e6), base_attn / attn,
                base_kv / kv, (base_attn / attn) / (base_kv / kv));
  }
  std::printf("\nweights read per step: %.1f MB; GB/s counts weights + KV read per step.\n",
              weights / 1e6);
  // What crossed between the host and the backend's memory per batched step (the mean over the
  // timed steps): on a device, the sampled tokens back and the step's inputs down, and no copy
  // per layer.
  std::printf("\ncopies per step (host <-> %s backend memory)\n%-22s %14s %13s %16s %15s\n",
              std::string(kernels::BackendName(lo.backend)).c_str(), "mode", "to_host_bytes",
              "to_host_calls", "to_device_bytes", "to_device_calls");
  for (const Mode& md : modes) {
    std::printf("%-22s %14.1f %13.2f %16.1f %15.2f\n", md.name.c_str(),
                static_cast<double>(md.copies.to_host_bytes) / steps,
                static_cast<double>(md.copies.to_host_calls) / steps,
                static_cast<double>(md.copies.to_device_bytes) / steps,
                static_cast<double>(md.copies.to_device_calls) / steps);
  }
  return 0;
}
