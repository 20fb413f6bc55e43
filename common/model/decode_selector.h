// DecodeSelector: how a decode step's sparse attention chooses, per cache head, which cached
// tokens it attends to. The modes (common/sparse) implement it; the model calls it per layer.
//
// On a host backend the model plans every sequence's selection for a layer, then selects all
// their cache heads together on the backend's threads (SelectHead), each head attended in the
// same task. On a backend whose memory the host does not read (a GPU), a selector that
// SelectsOnBackend describes its selection as the backend's selection ops (PlanOnBackend:
// summary updates, page scores, top-k), which the model batches over the step's sequences, so
// that nothing crosses to the host; any other selector is run on the host from copies.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/kv_cache.h"
#include "kernels/backend.h"

namespace kvwire {

// One layer's selection for one sequence, as the backend's ops (kernels/selection.h) the
// model runs for every sequence of a step at once, in this order.
struct BackendSelection {
  std::vector<kernels::SummaryUpdateSegment> updates;  // page summaries brought up to date
  std::vector<kernels::PageScoreSegment> scores;       // one per cache head
  std::vector<kernels::TopKSegment> top_k;             // one per cache head, best first
  // [n_cache_heads, num_indices] in backend memory: what top_k writes, the attention's indices.
  const int32_t* indices = nullptr;
};

// Picks, per cache head, which cached tokens a decode step attends to (sparse attention).
// Per layer and step the model calls Plan once, then SelectHead for every cache head, then
// Done. The SelectHead calls of one step run in parallel, over the heads of every sequence in
// the batch; Select runs the same calls one after another on the calling thread, and the
// parallel selection must equal it.
class DecodeSelector {
 public:
  virtual ~DecodeSelector() = default;
  // `cache` already holds the new token. Returns false for dense attention over all
  // cache.len tokens, or true and *num_indices (1 ≤ n ≤ cache.len), the tokens each cache
  // head will attend.
  virtual absl::StatusOr<bool> Plan(int layer, const LayerCache& cache, int* num_indices) = 0;
  // After Plan returned true: writes cache head `head`'s *num_indices token indices to `out`.
  // q: [n_heads, head_dim] after RoPE. Calls for different heads may run at the same time
  // (and alongside other selectors' calls, and other heads' attention), never alongside Plan
  // or Done.
  virtual void SelectHead(int layer, const float* q, const LayerCache& cache, int head,
                          int32_t* out) = 0;
  // After the heads were selected (or Plan returned false: indices null), with the whole
  // selection [n_cache_heads, num_indices]: for selectors that wrap another to inspect it.
  virtual void Done(int layer, const float* q, const LayerCache& cache, const int32_t* indices,
                    int num_indices) {}

  // Plan, every head in order, Done, on the calling thread: the serial selection. Returns
  // false for dense attention, or true with `indices` [n_cache_heads, *num_indices].
  absl::StatusOr<bool> Select(int layer, const float* q, const LayerCache& cache,
                              std::vector<int32_t>* indices, int* num_indices);

  // The device path: whether PlanOnBackend describes this selector's selection.
  virtual bool SelectsOnBackend() const { return false; }
  // After Plan returned true for `layer`: the selection of every cache head of `cache` (which
  // already counts the new token; its rows are in `backend`'s memory, at cache.k by
  // cache.layout) as backend ops, for the queries q [n_heads, head_dim] there. Buffers the ops
  // write are the selector's, in that backend's memory, and stay valid until its next call.
  virtual absl::Status PlanOnBackend(const std::shared_ptr<kernels::KernelBackend>& backend,
                                     int layer, const LayerCache& cache, const float* q,
                                     BackendSelection* out);
  // The ops of a step this selector planned never ran (a decode step's graph that failed
  // before it ran; the model runs the step again op by op): state kept about what the
  // backend's memory holds (how far its page summaries reach) no longer holds.
  virtual void StepUndone() {}
};

// A selector that watches another (or, with none, dense attention): Plan and SelectHead are
// the inner selector's; a subclass overrides Done, calling this one first, to see each
// layer's selection.
class WrappingSelector : public DecodeSelector {
 public:
  explicit WrappingSelector(DecodeSelector* inner) : inner_(inner) {}
  absl::StatusOr<bool> Plan(int layer, const LayerCache& cache, int* num_indices) override {
    if (inner_ == nullptr) return false;
    return inner_->Plan(layer, cache, num_indices);
  }
  void SelectHead(int layer, const float* q, const LayerCache& cache, int head,
                  int32_t* out) override {
    inner_->SelectHead(layer, q, cache, head, out);
  }
  void Done(int layer, const float* q, const LayerCache& cache, const int32_t* indices,
            int num_indices) override {
    if (inner_) inner_->Done(layer, q, cache, indices, num_indices);
  }
  void StepUndone() override {
    if (inner_) inner_->StepUndone();
  }

 private:
  DecodeSelector* inner_;
};

}  // namespace kvwire
