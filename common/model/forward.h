// The pieces of LlamaModel's forward pass its files share (llama_model.cc: loading, placement,
// the layers; decode_attention.cc: a decode step's attention): not part of the model's API.
#pragma once

#include <vector>

#include "common/model/llama_model.h"

namespace kvwire {

// Scratch of one forward pass over `rows` token rows, in the backend's memory; the MLP runs
// `chunk` rows at a time. `logits` holds logit_rows rows of logits on a GPU, or wherever the
// step samples on the backend (DecodeStepSampled); a host backend's logits otherwise go to the
// caller's array directly.
struct LlamaModel::Activations {
  int rows = 0, chunk = 0;
  int capacity = 0;  // rows allocated (a decode step's are reused for smaller batches)
  float *x = nullptr, *h = nullptr, *qkv = nullptr, *attn = nullptr, *gate_up = nullptr,
        *act = nullptr, *logits = nullptr;
  kernels::SampledToken* sampled = nullptr;  // a sampling step's tokens [rows]
  int32_t* positions = nullptr;
  // Where the inputs are written on the host: on a host backend, the token embeddings into x
  // (x_in) and the positions into positions; on a device, the positions into positions_host,
  // which UploadInputs copies, and the embeddings are looked up there (EmbedOnDevice; x_in null).
  std::vector<int32_t> positions_host;
  float* x_in = nullptr;
  int32_t* positions_in = nullptr;
  std::vector<BackendPtr> owned;
};

}  // namespace kvwire
