#include "common/base/shared_region.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace kvwire {
namespace {

constexpr char kPrefix[] = "/kvwire-";

absl::Status Errno(const std::string& what) {
  const int err = errno;
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

// 128 bits from the OS's random source, as hex: the name is the capability.
std::string RandomHex() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

}  // namespace

bool IsSharedRegionName(const std::string& name) {
  if (name.size() < sizeof(kPrefix) || name.size() > 80 ||
      name.compare(0, sizeof(kPrefix) - 1, kPrefix) != 0) {
    return false;
  }
  for (size_t i = sizeof(kPrefix) - 1; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == '-')) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared region of 0 bytes");
  const std::string name = absl::StrCat(kPrefix, getpid(), "-", RandomHex());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open ", name));
  // The pages reserved now (tmpfs has them or says ENOSPC), rather than on first touch, where a
  // full /dev/shm would be SIGBUS in the middle of a write.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    errno = err;
    absl::Status st = Errno(absl::StrCat("reserving ", bytes, " bytes for ", name));
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(st.message());
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    absl::Status st = Errno(absl::StrCat("mmap ", name));
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(st.message());
  }
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(name, static_cast<uint8_t*>(p), bytes, /*owner=*/true));
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Open(const std::string& name,
                                                                 size_t bytes) {
  if (!IsSharedRegionName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is not a kvwire shared region's name"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    if (errno == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no shared region ", name, " on this host"));
    }
    return Errno(absl::StrCat("shm_open ", name));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    absl::Status err = Errno(absl::StrCat("fstat ", name));
    close(fd);
    return err;
  }
  if (static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("shared region ", name, " holds ", st.st_size, " bytes, not ", bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap ", name));
  return std::unique_ptr<SharedRegion>(
      new SharedRegion(name, static_cast<uint8_t*>(p), bytes, /*owner=*/false));
}

void SharedRegion::Unlink() {
  if (!owner_ || unlinked_) return;
  shm_unlink(name_.c_str());
  unlinked_ = true;
}

absl::StatusOr<size_t> SharedRegionRoom() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return Errno("statvfs /dev/shm");
  return static_cast<size_t>(st.f_bavail) * st.f_frsize;
}

int SweepSharedRegions() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (dirent* e = readdir(dir)) {
    const std::string name = absl::StrCat("/", e->d_name);
    if (!IsSharedRegionName(name)) continue;
    // "/kvwire-<pid>-<hex>": a pid that no process has (kill's ESRCH) left it behind.
    const long pid = std::strtol(name.c_str() + sizeof(kPrefix) - 1, nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH &&
        shm_unlink(name.c_str()) == 0) {
      ++removed;
    }
  }
  closedir(dir);
  return removed;
}

SharedRegion::~SharedRegion() {
  Unlink();
  munmap(data_, size_);
}

}  // namespace kvwire
