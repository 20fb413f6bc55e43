// Safetensors files: memory-mapped reading with every header field checked, and writing
// (for tests, tools and converted models).
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data; offsets are relative to the end of the header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvwire {

struct TensorView {
  std::string name;
  std::string dtype;  // as in the file: "F32", "BF16", "F16", "I64", ...
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t bytes = 0;

  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates the header: its length against the file size,
  // JSON syntax, every tensor's dtype, shape and offsets (inside the data, sized
  // numel · element size, not overlapping). Errors name the file and the tensor.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // The same checks on a file's contents held in memory; the result keeps its own copy,
  // which the views point into. `source` names the input in errors, as the path does.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string bytes,
                                                                    std::string source);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Null when absent.
  const TensorView* Find(absl::string_view name) const;
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  // Reads the header of the `size` bytes at `bytes` (the map or owned_) into tensors_ and
  // metadata_.
  absl::Status Parse(const uint8_t* bytes, uint64_t size);

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::string owned_;  // FromBytes' copy
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Bytes per element for a safetensors dtype name, 0 when unknown.
size_t SafetensorsDTypeSize(absl::string_view dtype);

struct TensorToWrite {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16", "I32", "I64"
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel · element size bytes
};

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// A model's weights: one model.safetensors, or the shards listed by
// model.safetensors.index.json ("weight_map": tensor name → file).
class WeightFiles {
 public:
  static absl::StatusOr<std::unique_ptr<WeightFiles>> OpenDirectory(const std::string& dir);
  // NotFound naming the tensor and the files searched when absent.
  absl::StatusOr<const TensorView*> Get(absl::string_view name) const;
  const TensorView* Find(absl::string_view name) const;
  std::string Describe()
      const;  // "model.safetensors" or "3 shards of model.safetensors.index.json"

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> index_;
  std::string description_;
};

}  // namespace kvwire
