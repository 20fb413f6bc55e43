#include "common/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"

namespace kvwire {
namespace {

using nlohmann::json;

// A header larger than this is not a weights file (real ones are well under 10 MiB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

absl::Status FileError(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

absl::Status TooShort(const std::string& path, uint64_t size) {
  return FileError(path, absl::StrCat("file is ", size,
                                      " bytes; a safetensors file starts with an 8-byte "
                                      "header length"));
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t SafetensorsDTypeSize(absl::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

namespace {

// One tensor entry of the header: dtype, shape and data_offsets, checked against each other
// and against the `data_size` bytes after the header.
absl::StatusOr<TensorView> ParseTensorEntry(const std::string& path, const std::string& name,
                                            const json& t, const uint8_t* data,
                                            uint64_t data_size) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
      !t.contains("data_offsets")) {
    return FileError(
        path, absl::StrCat(where, ": expected an object with dtype, shape and data_offsets"));
  }
  TensorView view;
  view.name = name;
  if (!t["dtype"].is_string())
    return FileError(path, absl::StrCat(where, ": dtype is not a string"));
  view.dtype = t["dtype"].get<std::string>();
  const size_t elem = SafetensorsDTypeSize(view.dtype);
  if (elem == 0) return FileError(path, absl::StrCat(where, ": unknown dtype '", view.dtype, "'"));
  if (!t["shape"].is_array())
    return FileError(path, absl::StrCat(where, ": shape is not an array"));
  uint64_t numel = 1;
  for (const json& d : t["shape"]) {
    if (!d.is_number_unsigned()) {
      return FileError(
          path,
          absl::StrCat(where, ": shape entries must be non-negative integers, got ", d.dump()));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / 8 / dim) {
      return FileError(path, absl::StrCat(where, ": shape overflows"));
    }
    numel *= dim;
    view.shape.push_back(static_cast<int64_t>(dim));
  }
  const json& off = t["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned()) {
    return FileError(path, absl::StrCat(where, ": data_offsets must be [begin, end]"));
  }
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (begin > end || end > data_size) {
    return FileError(
        path, absl::StrCat(where, ": data_offsets [", begin, ", ", end, "] outside the ", data_size,
                           " data bytes (truncated file?)"));
  }
  if (end - begin != numel * elem) {
    return FileError(
        path, absl::StrCat(where, ": shape ", ShapeString(view.shape), " of ", view.dtype,
                           " needs ", numel * elem, " bytes but data_offsets span ", end - begin));
  }
  view.data = data + begin;
  view.bytes = end - begin;
  return view;
}

// The whole file, mapped read-only.
absl::StatusOr<std::pair<void*, uint64_t>> MapFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::PermissionDeniedError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return FileError(path, "not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {  // nothing to map
    ::close(fd);
    return TooShort(path, size);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED)
    return FileError(path, absl::StrCat("mmap failed: ", std::strerror(errno)));
  return std::make_pair(map, size);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(auto mapped, MapFile(path));
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->map_ = mapped.first;
  file->map_size_ = mapped.second;
  RETURN_IF_ERROR(file->Parse(static_cast<const uint8_t*>(mapped.first), mapped.second));
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(std::string bytes,
                                                                            std::string source) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = std::move(source);
  file->owned_ = std::move(bytes);
  RETURN_IF_ERROR(
      file->Parse(reinterpret_cast<const uint8_t*>(file->owned_.data()), file->owned_.size()));
  return file;
}

absl::Status SafetensorsFile::Parse(const uint8_t* bytes, uint64_t size) {
  if (size < 8) return TooShort(path_, size);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | bytes[i];
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return FileError(path_,
                     absl::StrCat("header length ", header_len, " does not fit in a file of ", size,
                                  " bytes (truncated file or not safetensors)"));
  }
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const json::exception& e) {
    return FileError(path_, absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) return FileError(path_, "header is not a JSON object");

  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return FileError(path_, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return FileError(path_, absl::StrCat("__metadata__.", m.key(), " is not a string"));
        }
        metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    ASSIGN_OR_RETURN(TensorView view, ParseTensorEntry(path_, it.key(), *it, data, data_size));
    const uint64_t begin = static_cast<uint64_t>(view.data - data);
    if (view.bytes > 0) ranges.emplace_back(begin, begin + view.bytes);
    tensors_.emplace(it.key(), std::move(view));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return FileError(path_, absl::StrCat("tensors overlap at data offset ", ranges[i].first));
    }
  }
  return absl::OkStatus();
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::Find(absl::string_view name) const {
  auto it = tensors_.find(std::string(name));
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<size_t> sizes;
  for (const TensorToWrite& t : tensors) {
    const size_t elem = SafetensorsDTypeSize(t.dtype);
    if (elem == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': unknown dtype '", t.dtype, "'"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': negative dim"));
      }
      numel *= static_cast<uint64_t>(d);
    }
    sizes.push_back(numel * elem);
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + numel * elem}}};
    offset += numel * elem;
  }
  std::string text = header.dump();
  // Pad the header with spaces to 8 bytes, as the reference writer does, for aligned data.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  uint64_t n = text.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    out.write(static_cast<const char*>(tensors[i].data), static_cast<std::streamsize>(sizes[i]));
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<WeightFiles>> WeightFiles::OpenDirectory(const std::string& dir) {
  auto files = std::make_unique<WeightFiles>();
  const std::string index_path = absl::StrCat(dir, "/model.safetensors.index.json");
  std::ifstream index_in(index_path);
  if (index_in) {
    json index;
    try {
      index = json::parse(index_in);
    } catch (const json::exception& e) {
      return FileError(index_path, absl::StrCat("not valid JSON: ", e.what()));
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return FileError(index_path, "expected an object with a \"weight_map\" object");
    }
    std::map<std::string, SafetensorsFile*> opened;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it->is_string()) {
        return FileError(index_path,
                         absl::StrCat("weight_map['", it.key(), "'] is not a file name"));
      }
      const std::string shard = it->get<std::string>();
      if (shard.find('/') != std::string::npos || shard.empty() || shard[0] == '.') {
        return FileError(index_path, absl::StrCat("weight_map['", it.key(), "'] = '", shard,
                                                  "' is not a file name in the model folder"));
      }
      if (!opened.count(shard)) {
        ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(absl::StrCat(dir, "/", shard)));
        opened[shard] = f.get();
        files->files_.push_back(std::move(f));
      }
      const TensorView* view = opened[shard]->Find(it.key());
      if (view == nullptr) {
        return FileError(index_path, absl::StrCat("weight_map says '", it.key(), "' is in ", shard,
                                                  " but that file has no such tensor"));
      }
      files->index_[it.key()] = view;
    }
    files->description_ =
        absl::StrCat(files->files_.size(), " shards of model.safetensors.index.json");
    return files;
  }
  ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(absl::StrCat(dir, "/model.safetensors")));
  for (const auto& [name, view] : f->tensors()) files->index_[name] = &view;
  files->files_.push_back(std::move(f));
  files->description_ = "model.safetensors";
  return files;
}

const TensorView* WeightFiles::Find(absl::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : it->second;
}

absl::StatusOr<const TensorView*> WeightFiles::Get(absl::string_view name) const {
  const TensorView* v = Find(name);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is missing from ", description_));
  }
  return v;
}

std::string WeightFiles::Describe() const { return description_; }

}  // namespace kvwire
