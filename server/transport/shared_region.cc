#include "transport/shared_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attn {

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::MapMemfd(int fd, uint64_t max_bytes) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "the descriptor is not a memfd that allows sealing (memfd_create with "
        "MFD_ALLOW_SEALING)");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "the memfd is not sealed against shrinking: add F_SEAL_SHRINK (fcntl F_ADD_SEALS) "
        "after sizing it");
  }
  const int mode = ::fcntl(fd, F_GETFL);
  if (mode < 0 || (mode & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError("the memfd must be open for reading and writing");
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("fstat: ", std::strerror(errno)));
  }
  if (st.st_size <= 0) return absl::InvalidArgumentError("the memfd is empty: size it first");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the memfd has ", size, " bytes, over the ", max_bytes,
        "-byte limit per client (attnd's --shm_max_bytes_per_client)"));
  }
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(absl::StrCat("mmap of the memfd: ", std::strerror(errno)));
  }
  return std::unique_ptr<SharedRegion>(new SharedRegion(static_cast<char*>(p), size, nullptr));
}

std::unique_ptr<SharedRegion> SharedRegion::Gpu(char* device_data, uint64_t size,
                                                std::function<void()> release) {
  return std::unique_ptr<SharedRegion>(new SharedRegion(device_data, size, std::move(release)));
}

void SharedRegion::SetDeviceRegistration(std::function<void()> unregister) {
  unregister_ = std::move(unregister);
}

SharedRegion::~SharedRegion() {
  if (release_) {
    release_();
    return;
  }
  // The device must let go of the pages before they are unmapped.
  if (unregister_) unregister_();
  ::munmap(data_, size_);
}

}  // namespace attn
