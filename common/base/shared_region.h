// A region of host memory that two processes on one host map: a POSIX shared-memory object
// (/dev/shm) with an unguessable name, made by the node that owns the memory (a decode node's
// KV cache) and opened by name by the one it is granted to (the prefill node that fills it;
// the name travels over the authenticated Prefill stream; the object is the owner's user's
// alone, mode 0600). The owner unlinks the name when it goes, and the memory lives until the
// last mapping goes. A process that dies leaves its names behind: the next owner on the host
// removes those of processes that are gone (SweepSharedRegions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvwire {

class SharedRegion {
 public:
  // A new region of `bytes` (zeroed), mode 0600, named "/kvwire-<pid>-<random>".
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(size_t bytes);
  // The region `name`, which must hold exactly `bytes`: NOT_FOUND when there is none (it was
  // never made on this host, or its owner has unlinked it), FAILED_PRECONDITION on a size
  // that differs.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Open(const std::string& name, size_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Removes the name (the owner's): no one else can open the region from now on. Idempotent.
  void Unlink();

 private:
  SharedRegion(std::string name, uint8_t* data, size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}
  std::string name_;
  uint8_t* data_;
  size_t size_;
  bool owner_;
  bool unlinked_ = false;
};

// Whether `name` has the form Create gives names (what a prefill node agrees to open).
bool IsSharedRegionName(const std::string& name);

// Unlinks the regions that processes no longer running made on this host; returns how many.
int SweepSharedRegions();

// Bytes free in /dev/shm, where the regions live (a container's is often 64 MiB).
absl::StatusOr<size_t> SharedRegionRoom();

}  // namespace kvwire
