#include "attn/client/host_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attn::client {

absl::StatusOr<std::unique_ptr<HostRegion>> HostRegion::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a region needs at least one byte");
  const int fd = ::memfd_create("attn-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  auto fail = [fd](absl::StatusCode code, const std::string& what) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return absl::Status(code, absl::StrCat(what, ": ", err));
  };
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail(absl::StatusCode::kResourceExhausted, "ftruncate");
  }
  // Backed now, so that no later access can fault for want of memory (a sparse file whose pages
  // cannot be allocated raises SIGBUS on first touch, in attnd or here).
  if (const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    errno = err;
    return fail(absl::StatusCode::kResourceExhausted, "posix_fallocate");
  }
  // attnd refuses a memfd that could shrink under its mapping.
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail(absl::StatusCode::kInternal, "F_ADD_SEALS");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail(absl::StatusCode::kResourceExhausted, "mmap");
  return std::unique_ptr<HostRegion>(new HostRegion(fd, static_cast<char*>(p), bytes));
}

HostRegion::~HostRegion() {
  ::munmap(data_, size_);
  ::close(fd_);
}

}  // namespace attn::client
