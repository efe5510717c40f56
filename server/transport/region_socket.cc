#include "transport/region_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attn {
namespace {

void Reply(int fd, const std::string& line) {
  ::send(fd, line.data(), line.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// True when the peer runs as attnd's user or as root.
bool PeerAllowed(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  return cred.uid == ::geteuid() || cred.uid == 0;
}

// Receives one message and at most one descriptor (more are closed). Returns the bytes read
// (0: the peer closed, < 0: error) and sets *fd (-1 when none came, or the control data was cut).
ssize_t ReceiveWithFd(int sock, char* buf, size_t len, int* fd) {
  *fd = -1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  iovec iov{buf, len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (n < 0) return n;
  int received = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* fds = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t i = 0; i < count; ++i) {
      if (received++ == 0) {
        *fd = fds[i];
      } else {
        ::close(fds[i]);
      }
    }
  }
  if (received > 1 || (msg.msg_flags & MSG_CTRUNC) != 0) {
    if (*fd >= 0) ::close(*fd);
    *fd = -2;  // more than one descriptor
  }
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionSocket>> RegionSocket::Listen(const std::string& path,
                                                                   RegionRegistry* registry) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm_socket must be a path of 1 to ", sizeof(addr.sun_path) - 1, " characters"));
  }
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ::unlink(path.c_str());  // a file left by an earlier attnd
  // Created 0600 (umask), so that the file system refuses other users before SO_PEERCRED does.
  const mode_t old_mask = ::umask(0177);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_mask);
  if (bound != 0 || ::listen(fd, 64) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on --shm_socket ", path, ": ", err));
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  }
  return std::unique_ptr<RegionSocket>(new RegionSocket(path, fd, wake, registry));
}

RegionSocket::RegionSocket(std::string path, int listen_fd, int wake_fd[2],
                           RegionRegistry* registry)
    : path_(std::move(path)),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_fd[0]),
      wake_write_fd_(wake_fd[1]),
      registry_(registry) {
  thread_ = std::thread([this] { Loop(); });
}

RegionSocket::~RegionSocket() {
  const char b = 0;
  (void)!::write(wake_write_fd_, &b, 1);
  thread_.join();
  for (const auto& [fd, connection] : connections_) {
    registry_->DropConnection(connection);
    ::close(fd);
  }
  ::close(listen_fd_);
  ::close(wake_read_fd_);
  ::close(wake_write_fd_);
  ::unlink(path_.c_str());
}

void RegionSocket::Loop() {
  for (;;) {
    std::vector<pollfd> fds = {{wake_read_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const auto& [fd, connection] : connections_) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) Accept();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = connections_.find(fds[i].fd);
      if (it == connections_.end()) continue;
      if (!Serve(it->first, it->second)) {
        // The client is gone (or broke the protocol): its regions go with it.
        registry_->DropConnection(it->second);
        ::close(it->first);
        connections_.erase(it);
      }
    }
  }
}

void RegionSocket::Accept() {
  const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return;
  if (!PeerAllowed(fd)) {
    Reply(fd, "ERR the region socket serves only processes of attnd's own user\n");
    ::close(fd);
    return;
  }
  // Each connection holds a descriptor of attnd's: bounded, so that no client can exhaust them.
  if (connections_.size() >= kMaxConnections) {
    Reply(fd, "ERR attnd's region socket has too many connections; close unused ones\n");
    ::close(fd);
    return;
  }
  connections_[fd] = next_connection_++;
}

bool RegionSocket::Serve(int fd, uint64_t connection) {
  char buf[64];
  int memfd = -1;
  const ssize_t n = ReceiveWithFd(fd, buf, sizeof(buf), &memfd);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  if (n <= 0) {
    if (memfd >= 0) ::close(memfd);
    return false;
  }
  if (n == 8 && std::memcmp(buf, kRegionSocketLease, 8) == 0) {
    if (memfd >= 0) ::close(memfd);
    auto lease = registry_->AddPending(nullptr, connection);
    Reply(fd, lease.ok() ? absl::StrCat("OK ", *lease, "\n")
                         : absl::StrCat("ERR ", lease.status().message(), "\n"));
    return true;
  }
  const bool vmm = n == 8 && std::memcmp(buf, kRegionSocketVmm, 8) == 0;
  if (!vmm && (n != 8 || std::memcmp(buf, kRegionSocketMagic, 8) != 0)) {
    if (memfd >= 0) ::close(memfd);
    Reply(fd, "ERR each message must be the 8 bytes ATTNFD01 with one memfd, ATTNVM01 with one "
              "CUDA VMM allocation's descriptor, or ATTNLS01\n");
    return true;
  }
  if (memfd == -2) {
    Reply(fd, "ERR send exactly one descriptor per message\n");
    return true;
  }
  if (memfd < 0) {
    Reply(fd, "ERR no descriptor came with the message (SCM_RIGHTS)\n");
    return true;
  }
  if (vmm) {
    // Checked when RegisterRegion imports it (only the device can tell what it is).
    auto handle = registry_->AddPendingVmm(memfd, connection);
    Reply(fd, handle.ok() ? absl::StrCat("OK ", *handle, "\n")
                          : absl::StrCat("ERR ", handle.status().message(), "\n"));
    return true;
  }
  auto region = SharedRegion::MapMemfd(
      memfd, static_cast<uint64_t>(registry_->options().max_bytes_per_client));
  ::close(memfd);  // the mapping keeps the memory; the descriptor is not needed
  if (!region.ok()) {
    Reply(fd, absl::StrCat("ERR ", region.status().message(), "\n"));
    return true;
  }
  auto handle = registry_->AddPending(std::move(*region), connection);
  Reply(fd, handle.ok() ? absl::StrCat("OK ", *handle, "\n")
                        : absl::StrCat("ERR ", handle.status().message(), "\n"));
  return true;
}

}  // namespace attn
