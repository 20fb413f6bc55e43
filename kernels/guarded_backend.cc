#include "kernels/guarded_backend.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "kernels/cpu_backend.h"
#include "kernels/socket_link.h"
#include "kernels/validate.h"

namespace kvwire::kernels {
namespace {

// A range of backend memory an op reads or writes: where, how many bytes, and its name in the
// op's parameters (for the error).
struct Extent {
  const void* p;
  int64_t bytes;
  const char* name;
};

// Elements from a cache's base that `n_heads` heads of `len` tokens in `l` reach: a region's
// last row, or the end of the rows of the highest page its table names (-1 when a page id is
// negative).
int64_t LayoutElements(const KvLayout& l, int n_heads, int len, int head_dim) {
  if (l.pages == nullptr) return (n_heads - 1) * l.head_stride + int64_t{len} * head_dim;
  int64_t top = 0;
  for (int64_t i = 0; i < l.TableEntries(len); ++i) {
    if (l.pages[i] < 0) return -1;
    top = std::max<int64_t>(top, l.pages[i]);
  }
  return top * l.page_stride + int64_t{l.heads_per_page} * l.page_tokens * head_dim;
}

// The page table of `l` (host memory, the caller's) copied into `store`, and `l` pointed at the
// copy: queued work must not depend on the caller's arrays, as a GPU's uploaded tables do not.
void OwnPages(KvLayout* l, int len, std::vector<std::vector<int32_t>>* store) {
  if (l->pages == nullptr) return;
  store->emplace_back(l->pages, l->pages + l->TableEntries(len));
  l->pages = store->back().data();
}
// A cache's tables at `len` tokens: its keys' (or rows') and a coded cache's values', each
// for the rows in its pages.
void OwnPages(KvLayout* kv, KvCoding* coding, int len, std::vector<std::vector<int32_t>>* store) {
  OwnPages(kv, coding->PagedRows(len), store);
  OwnPages(&coding->v_layout, coding->PagedRows(len), store);
}

int64_t Floats(int64_t n) { return n * static_cast<int64_t>(sizeof(float)); }

// The ranges of a cache's K and V rows for `len` tokens per head: in the dtype at `layout`, or a
// coded cache's (KvCoding) code and value rows (bytes), group parameters, scales and residual.
void RowExtents(const void* k, const void* v, const KvLayout& layout, const KvCoding& c,
                int n_heads, int len, int head_dim, DType dtype, std::vector<Extent>* ext) {
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  if (!c.coded()) {
    const int64_t kv = LayoutElements(layout, n_heads, len, head_dim) * es;
    ext->push_back({k, kv, "k"});
    ext->push_back({v, kv, "v"});
    return;
  }
  const int rows = c.ResidBegin(len);
  const int kc = static_cast<int>(KvKeyCodeBytes(c.format, dtype, head_dim));
  const int vc = static_cast<int>(KvValueRowBytes(c.format, dtype, head_dim));
  const int64_t groups = int64_t{n_heads} * c.max_groups;
  const int64_t resid = int64_t{n_heads} * c.resid_tokens * head_dim * es;
  ext->push_back({k, LayoutElements(layout, n_heads, rows, kc), "k"});
  ext->push_back({v, LayoutElements(c.v_layout, n_heads, rows, vc), "v"});
  ext->push_back(
      {c.k_params, groups * static_cast<int64_t>(KvKeyGroupBytes(c.format, head_dim)), "k_params"});
  ext->push_back({c.v_scales, c.format == KvFormat::kFP8 ? groups : 0, "v_scales"});
  ext->push_back({c.k_resid, resid, "k_resid"});
  ext->push_back({c.v_resid, resid, "v_resid"});
}
int64_t Ints(int64_t n) { return n * static_cast<int64_t>(sizeof(int32_t)); }
int64_t Elements(int64_t n, DType t) { return n * static_cast<int64_t>(DTypeSize(t)); }

class GuardedBackend final : public KernelBackend {
 public:
  GuardedBackend(int threads, size_t capacity)
      : inner_(MakeCpuBackend(threads)),
        page_(static_cast<size_t>(sysconf(_SC_PAGESIZE))),
        capacity_(capacity) {}
  ~GuardedBackend() override {
    Unexport();
    for (auto& [p, r] : regions_) {
      munmap(r.base, r.mapped);
      if (r.fd >= 0) close(r.fd);
    }
  }

  BackendKind kind() const override { return BackendKind::kGuarded; }
  bool host_addressable() const override { return false; }

  // Each buffer ends where a page that is never readable begins (rounded to 64 bytes, the
  // kernels' alignment): reading or writing past its end faults however the op was checked.
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t size = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    if (capacity_ > 0 && used_ + size > capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("guarded backend: ", bytes, " bytes do not fit: ", used_,
                       " of its capacity of ", capacity_, " bytes are in use"));
    }
    const size_t data = (size + page_ - 1) / page_ * page_;
    void* base = mmap(nullptr, data + page_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("guarded backend: cannot map ", bytes, " bytes: ", std::strerror(errno)));
    }
    auto* user = static_cast<uint8_t*>(base) + (data - size);
    regions_[user] = Region{base, data + page_, data, size};
    used_ += size;
    return static_cast<void*>(user);
  }
  // As cudaFree, waits for the queued work first (which may still use the buffer).
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    // cudaFree would wait for the work, which a recording has not queued: the graph is void.
    if (Recording* r = RecordingHere(); r != nullptr && r->error.ok()) {
      r->error = absl::FailedPreconditionError(
          "guarded backend: Free while this thread records a graph (its ops may use the buffer, "
          "and run only at EndGraph)");
    }
    FlushAllLocked();
    auto it = regions_.find(ptr);
    if (it == regions_.end() || it->second.imported) return;
    used_ -= it->second.size;
    munmap(it->second.base, it->second.mapped);
    if (it->second.fd >= 0) close(it->second.fd);
    if (!it->second.handle.empty()) {
      std::lock_guard<std::mutex> registry_lock(IpcRegistryMu());
      if (auto e = IpcRegistry().find(it->second.handle); e != IpcRegistry().end()) {
        close(e->second.fd);
        IpcRegistry().erase(e);
      }
    }
    regions_.erase(it);
  }
  absl::Status Synchronize() override {
    RETURN_IF_ERROR(RefuseWhileRecording("Synchronize"));
    // A device that faulted (MarkFaulted: a test's stand-in for CUDA's sticky errors) runs
    // nothing more: its queued work is dropped and every synchronisation fails with the fault.
    if (absl::Status f = fault(); !f.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      queues_.clear();
      return f;
    }
    std::lock_guard<std::mutex> lock(mu_);
    absl::Status st = FlushLocked();
    if (auto it = deferred_.find(std::this_thread::get_id()); it != deferred_.end()) {
      st.Update(it->second);
      deferred_.erase(it);
    }
    return st;
  }
  // Host work (sparse selection on the host) on the CPU backend's threads, at once: it reads
  // no backend memory.
  void HostParallelFor(int64_t n, const std::function<void(int64_t, int64_t)>& fn) override {
    inner_->HostParallelFor(n, fn);
  }

  // Every op is checked when it is called (shapes, then every range of memory it touches must
  // lie within one of this backend's buffers), then queued; the queue runs at the next
  // synchronisation (Synchronize, CopyToHost, Free), as a stream's work runs on a GPU.
  absl::Status MatMul(const MatMulParams& p) override {
    RETURN_IF_ERROR(ValidateMatMul(p));
    const int64_t xs = p.x_stride ? p.x_stride : p.k, ys = p.y_stride ? p.y_stride : p.n;
    return Queue("MatMul",
                 {{p.x, Floats((p.m - 1) * xs + p.k), "x"},
                  {p.w, Elements(int64_t{p.n} * p.k, p.w_dtype), "w"},
                  {p.bias, Floats(p.n), "bias"},
                  {p.y, Floats((p.m - 1) * ys + p.n), "y"}},
                 [this, p] { return inner_->MatMul(p); });
  }
  absl::Status RmsNorm(const RmsNormParams& p) override {
    RETURN_IF_ERROR(ValidateRmsNorm(p));
    const int64_t n = Floats(int64_t{p.rows} * p.dim);
    return Queue("RmsNorm",
                 {{p.x, n, "x"},
                  {p.weight, Floats(p.dim), "weight"},
                  {p.y, n, "y"},
                  {p.residual, n, "residual"}},
                 [this, p] { return inner_->RmsNorm(p); });
  }
  absl::Status Rope(const RopeParams& p) override {
    RETURN_IF_ERROR(ValidateRope(p));
    return Queue("Rope",
                 {{p.x, Floats((p.rows - 1) * p.row_stride + int64_t{p.heads} * p.head_dim), "x"},
                  {p.positions, Ints(p.rows), "positions"},
                  {p.inv_freq, Floats(p.head_dim / 2), "inv_freq"}},
                 [this, p] { return inner_->Rope(p); });
  }
  absl::Status SwiGlu(const SwiGluParams& p) override {
    RETURN_IF_ERROR(ValidateSwiGlu(p));
    return Queue("SwiGlu",
                 {{p.gate_up, Floats(2 * int64_t{p.rows} * p.ffn), "gate_up"},
                  {p.out, Floats(int64_t{p.rows} * p.ffn), "out"}},
                 [this, p] { return inner_->SwiGlu(p); });
  }
  absl::Status PrefillAttention(const PrefillAttentionParams& p) override {
    RETURN_IF_ERROR(ValidatePrefillAttention(p));
    const int64_t last = p.len - 1, qd = int64_t{p.n_heads} * p.head_dim,
                  kvd = int64_t{p.n_kv_heads} * p.head_dim;
    return Queue("PrefillAttention",
                 {{p.q, Floats(last * p.q_stride + qd), "q"},
                  {p.k, Floats(last * p.kv_stride + kvd), "k"},
                  {p.v, Floats(last * p.kv_stride + kvd), "v"},
                  {p.out, Floats(last * p.out_stride + qd), "out"},
                  {p.window_scores, Floats(int64_t{p.n_heads} * p.window * p.len), "scores"}},
                 [this, p] { return inner_->PrefillAttention(p); });
  }
  absl::Status DecodeAttention(const DecodeAttentionParams& p) override {
    RETURN_IF_ERROR(ValidateDecodeAttention(p));
    std::vector<Extent> ext;
    const int64_t qd = int64_t{p.n_heads} * p.head_dim;
    for (int b = 0; b < p.batch; ++b) {
      const DecodeSequence& s = p.seqs[b];
      RowExtents(s.k, s.v, s.layout, s.coding, p.n_cache_heads, s.len, p.head_dim, p.kv_dtype,
                 &ext);
      ext.insert(ext.end(), {{s.q, Floats(qd), "q"},
                             {s.out, Floats(qd), "out"},
                             {s.indices, Ints(int64_t{p.n_cache_heads} * s.num_indices), "indices"},
                             {s.probs, Floats(int64_t{p.n_heads} * s.len), "probs"}});
    }
    // The table of sequences and their page tables are the caller's: copied now, as the CUDA
    // backend uploads them.
    std::vector<DecodeSequence> seqs(p.seqs, p.seqs + p.batch);
    auto pages = std::make_shared<std::vector<std::vector<int32_t>>>();
    for (DecodeSequence& seq : seqs) {
      OwnPages(&seq.layout, &seq.coding, seq.len, pages.get());
    }
    return Queue("DecodeAttention", ext, [this, p, seqs, pages]() mutable {
      DecodeAttentionParams q = p;
      q.seqs = seqs.data();
      return inner_->DecodeAttention(q);
    });
  }
  absl::Status EmbedRows(const EmbedRowsParams& p) override {
    RETURN_IF_ERROR(ValidateEmbedRows(p));
    const int64_t table = int64_t{p.vocab} * p.hidden * static_cast<int64_t>(DTypeSize(p.dtype));
    std::vector<int32_t> ids(p.ids, p.ids + p.n);  // a host array: copied now, as CUDA uploads it
    return Queue("EmbedRows",
                 {{p.table, table, "table"}, {p.out, Floats(int64_t{p.n} * p.hidden), "out"}},
                 [this, p, ids = std::move(ids)] {
                   EmbedRowsParams q = p;
                   q.ids = ids.data();
                   return inner_->EmbedRows(q);
                 });
  }
  absl::Status AppendKv(const AppendKvParams& p) override {
    RETURN_IF_ERROR(ValidateAppendKv(p));
    std::vector<Extent> ext;
    const int64_t kvd = Floats(int64_t{p.n_kv_heads} * p.head_dim);
    for (int b = 0; b < p.batch; ++b) {
      const KvAppend& s = p.seqs[b];
      RowExtents(s.k_cache, s.v_cache, s.layout, s.coding, p.n_cache_heads, s.t + 1, p.head_dim,
                 p.kv_dtype, &ext);
      ext.insert(ext.end(), {{s.k, kvd, "k"}, {s.v, kvd, "v"}});
    }
    std::vector<KvAppend> seqs(p.seqs, p.seqs + p.batch);
    auto pages = std::make_shared<std::vector<std::vector<int32_t>>>();
    for (KvAppend& seq : seqs) {
      OwnPages(&seq.layout, &seq.coding, seq.t + 1, pages.get());
    }
    return Queue("AppendKv", ext, [this, p, seqs, pages]() mutable {
      AppendKvParams q = p;
      q.seqs = seqs.data();
      return inner_->AppendKv(q);
    });
  }

  absl::Status WindowVotes(const WindowVotesParams& p) override {
    RETURN_IF_ERROR(ValidateWindowVotes(p));
    return Queue("WindowVotes",
                 {{p.scores, Floats(int64_t{p.n_heads} * p.window * p.len), "scores"},
                  {p.votes, Floats(int64_t{p.n_heads / p.group} * p.prefix), "votes"}},
                 [this, p] { return inner_->WindowVotes(p); });
  }
  absl::Status Pool1d(const Pool1dParams& p) override {
    RETURN_IF_ERROR(ValidatePool1d(p));
    const int64_t n = Floats(int64_t{p.rows} * p.n);
    return Queue("Pool1d", {{p.x, n, "x"}, {p.y, n, "y"}}, [this, p] { return inner_->Pool1d(p); });
  }
  absl::Status RunMeans(const RunMeansParams& p) override {
    RETURN_IF_ERROR(ValidateRunMeans(p));
    return Queue("RunMeans",
                 {{p.x, Floats(int64_t{p.rows} * p.n), "x"},
                  {p.y, Floats(int64_t{p.rows} * ((p.n + p.run - 1) / p.run)), "y"}},
                 [this, p] { return inner_->RunMeans(p); });
  }
  absl::Status TopK(const TopKParams& p) override {
    RETURN_IF_ERROR(ValidateTopK(p));
    std::vector<Extent> ext;
    for (int i = 0; i < p.count; ++i) {
      const TopKSegment& s = p.segs[i];
      ext.insert(ext.end(), {{s.score, Floats((s.n + s.run - 1) / s.run), "score"},
                             {s.tie, Floats(s.n), "tie"},
                             {s.out, Ints(int64_t{s.k} + s.append), "out"}});
    }
    std::vector<TopKSegment> segs(p.segs, p.segs + p.count);
    return Queue("TopK", ext, [this, p, segs]() mutable {
      TopKParams q = p;
      q.segs = segs.data();
      return inner_->TopK(q);
    });
  }
  absl::Status HbwSelect(const HbwSelectParams& p) override {
    RETURN_IF_ERROR(ValidateHbwSelect(p));
    const int64_t blocks = (p.prefix + p.block - 1) / p.block;
    return Queue("HbwSelect",
                 {{p.block_scores, Floats(p.rows * blocks), "block_scores"},
                  {p.out, Ints(int64_t{p.rows} * (p.prefix_budget + p.append)), "out"}},
                 [this, p] { return inner_->HbwSelect(p); });
  }
  absl::Status GatherKv(const GatherKvParams& p) override {
    RETURN_IF_ERROR(ValidateGatherKv(p));
    const int64_t rows = Floats((p.len - 1) * p.kv_stride + int64_t{p.n_kv_heads} * p.head_dim);
    const int64_t out = Elements(int64_t{p.n_cache_heads} * p.count * p.head_dim, p.dtype);
    return Queue("GatherKv",
                 {{p.k, rows, "k"},
                  {p.v, rows, "v"},
                  {p.kept, Ints(int64_t{p.n_cache_heads} * p.count), "kept"},
                  {p.k_out, out, "k_out"},
                  {p.v_out, out, "v_out"}},
                 [this, p] { return inner_->GatherKv(p); });
  }
  absl::Status UpdateSummaries(const UpdateSummariesParams& p) override {
    RETURN_IF_ERROR(ValidateUpdateSummaries(p));
    std::vector<Extent> ext;
    for (int i = 0; i < p.count; ++i) {
      const SummaryUpdateSegment& s = p.segs[i];
      const DType t = s.layout.dtype;
      RowExtents(s.k, nullptr, s.kv, s.coding, s.n_heads, s.len, s.layout.head_dim, t, &ext);
      ext.push_back({s.summaries, Elements(s.n_heads * s.layout.head_elems(), t), "summaries"});
    }
    std::vector<SummaryUpdateSegment> segs(p.segs, p.segs + p.count);
    auto pages = std::make_shared<std::vector<std::vector<int32_t>>>();
    for (SummaryUpdateSegment& seg : segs) {
      OwnPages(&seg.kv, &seg.coding, seg.len, pages.get());
    }
    return Queue("UpdateSummaries", ext, [this, p, segs, pages]() mutable {
      UpdateSummariesParams q = p;
      q.segs = segs.data();
      return inner_->UpdateSummaries(q);
    });
  }
  absl::Status PageScores(const PageScoresParams& p) override {
    RETURN_IF_ERROR(ValidatePageScores(p));
    std::vector<Extent> ext;
    for (int i = 0; i < p.count; ++i) {
      const PageScoreSegment& s = p.segs[i];
      const bool exact = s.kind == PageScoreKind::kExact;
      if (exact) {
        RowExtents(s.k, nullptr, s.kv, s.coding, s.head + 1, s.len, p.head_dim, p.dtype, &ext);
      }
      ext.insert(ext.end(), {{s.q, Floats(int64_t{s.group} * p.head_dim), "q"},
                             {exact ? nullptr : s.summaries,
                              Elements(s.layout.head_elems(), p.dtype), "summaries"},
                             {s.score, Floats(exact ? s.len : s.layout.pages(s.len)), "score"}});
    }
    std::vector<PageScoreSegment> segs(p.segs, p.segs + p.count);
    auto pages = std::make_shared<std::vector<std::vector<int32_t>>>();
    for (PageScoreSegment& seg : segs) {
      if (seg.kind == PageScoreKind::kExact) {
        OwnPages(&seg.kv, &seg.coding, seg.len, pages.get());
      }
    }
    return Queue("PageScores", ext, [this, p, segs, pages]() mutable {
      PageScoresParams q = p;
      q.segs = segs.data();
      return inner_->PageScores(q);
    });
  }
  absl::Status Sample(const SampleParams& p) override {
    RETURN_IF_ERROR(ValidateSample(p));
    const int64_t stride = p.stride ? p.stride : p.vocab;
    std::vector<SampleRow> rows(p.rows, p.rows + p.batch);
    return Queue("Sample",
                 {{p.logits, Floats((p.batch - 1) * stride + p.vocab), "logits"},
                  {p.out, static_cast<int64_t>(sizeof(SampledToken)) * p.batch, "out"}},
                 [this, p, rows]() mutable {
                   SampleParams q = p;
                   q.rows = rows.data();
                   return inner_->Sample(q);
                 });
  }
  absl::Status ChecksumSpans(const ChecksumSpansParams& p) override {
    RETURN_IF_ERROR(RefuseWhileRecording("ChecksumSpans"));
    RETURN_IF_ERROR(ValidateChecksumSpans(p));
    std::vector<Extent> ext;
    for (int i = 0; i < p.n; ++i) ext.push_back({p.spans[i].data, p.spans[i].bytes, "span"});
    std::vector<ByteSpan> spans(p.spans, p.spans + p.n);
    RETURN_IF_ERROR(Queue("ChecksumSpans", ext, [this, p, spans = std::move(spans)] {
      ChecksumSpansParams q = p;
      q.spans = spans.data();
      return inner_->ChecksumSpans(q);
    }));
    return Synchronize();  // returns with `out` (host memory) filled
  }
  absl::Status PackSpans(const PackSpansParams& p) override {
    RETURN_IF_ERROR(ValidatePackSpans(p));
    std::vector<Extent> ext;
    int64_t total = 0;
    for (int i = 0; i < p.n; ++i) {
      ext.push_back({p.spans[i].data, p.spans[i].bytes, "span"});
      total += p.spans[i].bytes;
    }
    ext.push_back({p.packed, total, "packed"});
    std::vector<ByteSpan> spans(p.spans, p.spans + p.n);
    return Queue("PackSpans", ext, [this, p, spans = std::move(spans)] {
      PackSpansParams q = p;
      q.spans = spans.data();
      return inner_->PackSpans(q);
    });
  }

  // CUDA IPC, emulated: the buffer's pages move into a memfd, which the importing backend maps
  // again at an address of its own, with a guard page and protections of its own. The handle
  // names the memfd as another process of this user opens it (/proc/PID/fd/FD) with the layout
  // of its pages, so two nodes on guarded backends run the cuda_ipc transport between processes
  // as on a GPU; within one process (a test's two nodes) the registry, standing for the driver,
  // resolves it. The exporter itself cannot import it, as CUDA refuses a process its own handle.
  absl::StatusOr<std::string> ExportMemory(void* base, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushAllLocked();
    auto it = regions_.find(base);
    if (it == regions_.end() || it->second.imported || bytes > it->second.size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "guarded backend: ExportMemory takes a buffer of this backend's (its start, at most "
          "its bytes); ",
          bytes, " bytes at this pointer are not one"));
    }
    Region& r = it->second;
    if (!r.handle.empty()) return r.handle;  // as CUDA, one handle per allocation
    RETURN_IF_ERROR(MoveToMemfd(&r));
    const int fd = dup(r.fd);
    if (fd < 0) return absl::InternalError(absl::StrCat("dup: ", std::strerror(errno)));
    // Never reused, as a new allocation at the same address gets a new CUDA handle.
    static std::atomic<uint64_t> exports{0};
    const uint8_t* user = static_cast<const uint8_t*>(base);
    const auto offset = static_cast<size_t>(user - static_cast<uint8_t*>(r.base));
    r.handle = absl::StrCat("guarded-ipc:", getpid(), ":", fd, ":", r.data, ":", offset, ":",
                            r.size, ":", ++exports);
    std::lock_guard<std::mutex> registry_lock(IpcRegistryMu());
    IpcRegistry()[r.handle] = {fd, r.data, offset, r.size, this};
    return r.handle;
  }
  absl::StatusOr<void*> ImportMemory(const std::string& handle, size_t bytes) override {
    Exported e;
    {
      std::lock_guard<std::mutex> registry_lock(IpcRegistryMu());
      auto it = IpcRegistry().find(handle);
      if (it != IpcRegistry().end()) {
        e = it->second;
        e.fd = dup(e.fd);
        if (e.fd < 0) return absl::InternalError(absl::StrCat("dup: ", std::strerror(errno)));
      }
    }
    if (e.fd < 0) {
      ASSIGN_OR_RETURN(e, OpenExported(handle));
    }
    struct Closer {
      int fd;
      ~Closer() { close(fd); }
    } closer{e.fd};
    if (e.exporter == this) {
      return absl::FailedPreconditionError(
          "guarded backend: a backend cannot import its own memory (CUDA IPC refuses a process "
          "its own handle)");
    }
    if (bytes > e.size) {
      return absl::InvalidArgumentError(absl::StrCat("guarded backend: the exported buffer has ",
                                                     e.size, " bytes; ", bytes, " were asked"));
    }
    void* base = mmap(nullptr, e.data + page_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("guarded backend: cannot map an import: ", std::strerror(errno)));
    }
    if (mmap(base, e.data, PROT_NONE, MAP_SHARED | MAP_FIXED, e.fd, 0) == MAP_FAILED) {
      const int err = errno;
      munmap(base, e.data + page_);
      return absl::InternalError(absl::StrCat("guarded backend: mmap: ", std::strerror(err)));
    }
    auto* user = static_cast<uint8_t*>(base) + e.offset;
    std::lock_guard<std::mutex> lock(mu_);
    Region r{base, e.data + page_, e.data, e.size};
    r.imported = true;
    regions_[user] = r;
    return static_cast<void*>(user);
  }
  // Graphs, emulated: a thread's recorded ops are held apart from the queue and join it at
  // EndGraph, so a step that reads a result before then, or relies on a host array after its
  // call, fails here as it would on a GPU.
  bool SupportsGraphs() const override { return true; }
  absl::Status BeginGraph(int64_t key) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (RecordingHere() != nullptr) {
      return absl::FailedPreconditionError(
          "guarded backend: BeginGraph while this thread already records a graph");
    }
    recordings_[std::this_thread::get_id()].key = key;
    return absl::OkStatus();
  }
  absl::Status EndGraph() override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = recordings_.find(std::this_thread::get_id());
    if (it == recordings_.end()) {
      return absl::FailedPreconditionError("guarded backend: EndGraph without BeginGraph");
    }
    Recording r = std::move(it->second);
    recordings_.erase(it);
    RETURN_IF_ERROR(r.error);
    if (std::exchange(fail_next_graph_, false)) {
      return absl::InternalError("guarded backend: this graph fails, as the test asked");
    }
    for (Op& op : r.ops) queues_[std::this_thread::get_id()].push_back(std::move(op));
    ++(keys_.insert(r.key).second ? counts_.made : counts_.updated);
    ++counts_.launched;
    return absl::OkStatus();
  }
  void AbortGraph() override {
    std::lock_guard<std::mutex> lock(mu_);
    recordings_.erase(std::this_thread::get_id());
  }
  GraphCounts graph_counts() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return counts_;
  }
  void FailNextGraph() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_graph_ = true;
  }

  // NCCL, emulated: a loopback socket, through host buffers (kernels/socket_link.h).
  absl::StatusOr<std::unique_ptr<PeerLink>> OpenLink(std::string* offer) override {
    return OpenSocketLink(this, offer);
  }
  absl::StatusOr<std::unique_ptr<PeerLink>> JoinLink(const std::string& offer) override {
    return JoinSocketLink(this, offer);
  }
  void CloseImported(void* ptr) override {
    std::lock_guard<std::mutex> lock(mu_);
    FlushAllLocked();
    auto it = regions_.find(ptr);
    if (it == regions_.end() || !it->second.imported) return;
    munmap(it->second.base, it->second.mapped);
    regions_.erase(it);
  }

 protected:
  // The source is copied when the call is made (the caller may change or free it at once),
  // and lands in backend memory when the queue runs.
  absl::Status DoCopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::vector<uint8_t> data(static_cast<const uint8_t*>(src),
                              static_cast<const uint8_t*>(src) + bytes);
    return Queue("CopyToDevice", {{dst, static_cast<int64_t>(bytes), "dst"}},
                 [dst, data = std::move(data)] {
                   if (!data.empty()) std::memcpy(dst, data.data(), data.size());
                   return absl::OkStatus();
                 });
  }
  // Queued: WaitCopy synchronises.
  absl::StatusOr<CopyTicket> DoCopyToHostAsync(void* dst, const void* src, size_t bytes) override {
    RETURN_IF_ERROR(RefuseWhileRecording("CopyToHostAsync"));
    RETURN_IF_ERROR(
        Queue("CopyToHostAsync", {{src, static_cast<int64_t>(bytes), "src"}}, [dst, src, bytes] {
          if (bytes > 0) std::memcpy(dst, src, bytes);
          return absl::OkStatus();
        }));
    return CopyTicket{1};
  }
  absl::Status WaitCopy(CopyTicket) override {
    RETURN_IF_ERROR(RefuseWhileRecording("WaitCopy"));
    return Synchronize();
  }
  // Runs everything queued before it: returns with `dst` filled.
  absl::Status DoCopyToHost(void* dst, const void* src, size_t bytes) override {
    RETURN_IF_ERROR(RefuseWhileRecording("CopyToHost"));
    RETURN_IF_ERROR(
        Queue("CopyToHost", {{src, static_cast<int64_t>(bytes), "src"}}, [dst, src, bytes] {
          if (bytes > 0) std::memcpy(dst, src, bytes);
          return absl::OkStatus();
        }));
    return Synchronize();
  }

 private:
  struct Region {
    void* base;             // the mapping: the data pages, then the guard page
    size_t mapped;          // bytes mapped, the guard page included
    size_t data;            // bytes of the data pages
    size_t size;            // the buffer's own bytes, ending at the guard page
    int fd = -1;            // the memfd holding the data pages, once exported
    bool imported = false;  // another backend's buffer, mapped here (ImportMemory)
    std::string handle;     // its name in the registry, once exported
  };
  // An exported buffer: its memfd (this registry's own descriptor), its data pages, where the
  // buffer starts in them and its bytes, and the backend that exported it.
  struct Exported {
    int fd = -1;
    size_t data = 0, offset = 0, size = 0;
    const GuardedBackend* exporter = nullptr;
  };
  static std::mutex& IpcRegistryMu() {
    static std::mutex mu;
    return mu;
  }
  static std::map<std::string, Exported>& IpcRegistry() {
    static auto* registry = new std::map<std::string, Exported>();
    return *registry;
  }
  // Another process's export, by its handle: "guarded-ipc:PID:FD:DATA:OFFSET:SIZE:N".
  static absl::StatusOr<Exported> OpenExported(const std::string& handle) {
    const std::vector<std::string> f = absl::StrSplit(handle, ':');
    int64_t pid = 0, fd = 0;
    uint64_t data = 0, offset = 0, size = 0;
    if (f.size() != 7 || f[0] != "guarded-ipc" || !absl::SimpleAtoi(f[1], &pid) ||
        !absl::SimpleAtoi(f[2], &fd) || !absl::SimpleAtoi(f[3], &data) ||
        !absl::SimpleAtoi(f[4], &offset) || !absl::SimpleAtoi(f[5], &size) || pid <= 0 || fd < 0 ||
        offset + size > data) {
      return absl::InvalidArgumentError("guarded backend: not a guarded IPC handle");
    }
    if (pid == getpid()) {
      return absl::NotFoundError(
          "guarded backend: no buffer of this process was exported under that handle");
    }
    Exported e;
    e.fd = open(absl::StrCat("/proc/", pid, "/fd/", fd).c_str(), O_RDWR | O_CLOEXEC);
    if (e.fd < 0) {
      return absl::NotFoundError(absl::StrCat("guarded backend: the exporting process ", pid,
                                              " has no such buffer: ", std::strerror(errno)));
    }
    struct stat st;
    if (fstat(e.fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != data) {
      close(e.fd);
      return absl::InvalidArgumentError(
          "guarded backend: the handle's buffer is not the size it says");
    }
    e.data = data;
    e.offset = offset;
    e.size = size;
    return e;
  }
  // Forgets what this backend exported (handles of a backend that is gone import nothing).
  void Unexport() {
    std::lock_guard<std::mutex> registry_lock(IpcRegistryMu());
    for (auto it = IpcRegistry().begin(); it != IpcRegistry().end();) {
      if (it->second.exporter != this) {
        ++it;
        continue;
      }
      close(it->second.fd);
      it = IpcRegistry().erase(it);
    }
  }
  // The buffer's data pages replaced by a memfd's holding the same bytes, at the same address.
  absl::Status MoveToMemfd(Region* r) {
    const int fd = memfd_create("kvwire-guarded", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    auto fail = [&](const char* what) {
      absl::Status st = absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
      close(fd);
      return st;
    };
    if (ftruncate(fd, static_cast<off_t>(r->data)) != 0) return fail("ftruncate");
    void* copy = mmap(nullptr, r->data, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (copy == MAP_FAILED) return fail("mmap");
    const bool readable = mprotect(r->base, r->data, PROT_READ) == 0;
    if (readable) std::memcpy(copy, r->base, r->data);
    munmap(copy, r->data);
    if (!readable) return fail("mprotect");
    if (mmap(r->base, r->data, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      return fail("mmap");
    }
    r->fd = fd;
    return absl::OkStatus();
  }
  struct Op {
    const char* name;
    std::function<absl::Status()> run;
  };
  // A thread's graph being recorded (BeginGraph): its ops, and what already voids it.
  struct Recording {
    int64_t key = 0;
    std::deque<Op> ops;
    absl::Status error;
  };
  Recording* RecordingHere() {
    auto it = recordings_.find(std::this_thread::get_id());
    return it == recordings_.end() ? nullptr : &it->second;
  }
  absl::Status RefuseWhileRecording(const char* call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (RecordingHere() == nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("guarded backend: ", call,
                     " while this thread records a graph: its work runs at EndGraph, and "
                     "nothing may wait for it or read its results before then"));
  }

  // Null (with any extent), or [p, p + bytes) inside one buffer of this backend.
  bool Within(const Extent& e) const {
    if (e.p == nullptr) return true;
    auto it = regions_.upper_bound(const_cast<void*>(e.p));
    if (it == regions_.begin()) return false;
    --it;
    const auto* start = static_cast<const uint8_t*>(it->first);
    const auto* p = static_cast<const uint8_t*>(e.p);
    return p >= start && e.bytes >= 0 && p + e.bytes <= start + it->second.size;
  }

  template <typename F>
  absl::Status Queue(const char* op_name, const std::vector<Extent>& extents, F&& run) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Extent& e : extents) {
      if (!Within(e)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "guarded backend: ", op_name, "'s ", e.name, " (", e.bytes,
            " bytes) is not within one buffer of this backend (a host pointer, or a range "
            "past a buffer's end)"));
      }
    }
    if (Recording* r = RecordingHere(); r != nullptr) {
      r->ops.push_back({op_name, std::forward<F>(run)});
    } else {
      queues_[std::this_thread::get_id()].push_back({op_name, std::forward<F>(run)});
    }
    return absl::OkStatus();
  }

  // Opens every buffer, runs the calling thread's queue in order (its stream's work: what
  // cudaStreamSynchronize waits for), closes them again. The first failure is returned and the
  // rest of the queue dropped, as a faulted stream's work would be.
  absl::Status FlushLocked() {
    auto it = queues_.find(std::this_thread::get_id());
    if (it == queues_.end()) return absl::OkStatus();
    std::deque<Op> queue = std::move(it->second);
    queues_.erase(it);
    return RunLocked(queue);
  }
  // Every thread's queue, one after another: what a device-wide wait (cudaFree) waits for. A
  // failure is the queuing thread's, reported at its next synchronisation.
  void FlushAllLocked() {
    while (!queues_.empty()) {
      const std::thread::id owner = queues_.begin()->first;
      std::deque<Op> queue = std::move(queues_.begin()->second);
      queues_.erase(queues_.begin());
      if (absl::Status st = RunLocked(queue); !st.ok()) deferred_.emplace(owner, st);
    }
  }
  absl::Status RunLocked(std::deque<Op>& queue) {
    if (queue.empty()) return absl::OkStatus();
    RETURN_IF_ERROR(Protect(PROT_READ | PROT_WRITE));
    absl::Status st;
    while (!queue.empty()) {
      Op op = std::move(queue.front());
      queue.pop_front();
      if (!st.ok()) continue;
      st = op.run();
      if (!st.ok()) st = Annotate(st, absl::StrCat("guarded backend, queued ", op.name));
    }
    RETURN_IF_ERROR(Protect(PROT_NONE));
    return st;
  }
  absl::Status Protect(int prot) {
    for (auto& [p, r] : regions_) {
      if (mprotect(r.base, r.data, prot) != 0) {
        return absl::InternalError(
            absl::StrCat("guarded backend: mprotect: ", std::strerror(errno)));
      }
    }
    return absl::OkStatus();
  }

  KernelBackendPtr inner_;
  const size_t page_;
  const size_t capacity_;  // 0: no limit
  mutable std::mutex mu_;
  std::map<void*, Region> regions_;  // by the buffer's start
  size_t used_ = 0;
  // Each thread's queued work, as each thread's lane has a stream of its own on CUDA: one
  // thread's synchronisation runs its own work only, so work another thread reads must be
  // waited for by the thread that queued it.
  std::map<std::thread::id, std::deque<Op>> queues_;
  // A thread's failed work that another thread's device-wide wait ran (Free), for the first
  // thread's next synchronisation.
  std::map<std::thread::id, absl::Status> deferred_;
  std::map<std::thread::id, Recording> recordings_;
  std::set<int64_t> keys_;  // graphs "made"
  GraphCounts counts_;
  bool fail_next_graph_ = false;
};

}  // namespace

KernelBackendPtr MakeGuardedBackend(int threads, size_t capacity) {
  return std::make_unique<GuardedBackend>(threads, capacity);
}

void FailNextGraphForTest(KernelBackend& backend) {
  if (auto* guarded = dynamic_cast<GuardedBackend*>(&backend)) guarded->FailNextGraph();
}

}  // namespace kvwire::kernels
