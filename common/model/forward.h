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
  // Where the inputs (token embeddings, positions) are written on the host: x and positions
  // themselves on a host backend, else these arrays, which UploadInputs copies to the device.
  std::vector<float> x_host;
  std::vector<int32_t> positions_host;
  float* x_in = nullptr;
  int32_t* positions_in = nullptr;
  std::vector<BackendPtr> owned;
};

}  // namespace kvwire
