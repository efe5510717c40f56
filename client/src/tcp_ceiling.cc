#include "attn/client/tcp_ceiling.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

namespace attn::client {
namespace {

using Clock = std::chrono::steady_clock;

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Closes its descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void NoDelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Answers calls on one accepted connection until the client closes it.
void ServeConnection(int fd, size_t response_bytes) {
  std::vector<char> in(1 << 20);
  const std::vector<char> out(response_bytes, '\x5a');
  for (;;) {
    uint64_t len = 0;
    if (!ReadAll(fd, reinterpret_cast<char*>(&len), sizeof(len))) return;
    for (uint64_t left = len; left > 0;) {  // drained in 1 MiB reads, as a receiver would
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, in.size()));
      if (!ReadAll(fd, in.data(), n)) return;
      left -= n;
    }
    if (!WriteAll(fd, out.data(), out.size())) return;
  }
}

// A closed loop of calls on one connection; counts those that end inside the measured window.
void RunClient(int fd, const TcpCeilingOptions& o, Clock::time_point from, Clock::time_point end,
               std::atomic<int64_t>* calls) {
  std::vector<char> request(sizeof(uint64_t) + o.request_bytes, '\x3c');
  const uint64_t len = o.request_bytes;
  std::memcpy(request.data(), &len, sizeof(len));
  std::vector<char> response(o.response_bytes);
  while (Clock::now() < end) {
    const auto sent = Clock::now();
    if (!WriteAll(fd, request.data(), request.size())) return;
    if (!ReadAll(fd, response.data(), response.size())) return;
    const auto done = Clock::now();
    if (sent >= from && done <= end) calls->fetch_add(1);
  }
}

absl::StatusOr<Fd> Listen(int backlog, int* port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return Errno("bind");
  if (::listen(fd.get(), backlog) != 0) return Errno("listen");
  socklen_t len = sizeof(addr);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Errno("getsockname");
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

absl::StatusOr<Fd> Connect(int port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return Errno("connect");
  }
  NoDelay(fd.get());
  return fd;
}

}  // namespace

absl::StatusOr<TcpCeilingResult> MeasureTcpCeiling(const TcpCeilingOptions& o) {
  if (o.connections < 1 || o.seconds <= 0 || o.request_bytes == 0 || o.response_bytes == 0) {
    return absl::InvalidArgumentError(
        "tcp ceiling: connections >= 1, seconds > 0 and non-empty messages are required");
  }
  int port = 0;
  absl::StatusOr<Fd> listener = Listen(o.connections, &port);
  if (!listener.ok()) return listener.status();
  std::vector<Fd> client_fds, server_fds;
  for (int i = 0; i < o.connections; ++i) {
    absl::StatusOr<Fd> c = Connect(port);
    if (!c.ok()) return c.status();
    Fd s(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (s.get() < 0) return Errno("accept");
    NoDelay(s.get());
    client_fds.push_back(std::move(*c));
    server_fds.push_back(std::move(s));
  }
  const auto start = Clock::now();
  const auto from = start + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(o.warmup_s));
  const auto end = from + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(o.seconds));
  std::atomic<int64_t> calls{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < o.connections; ++i) {
    threads.emplace_back(ServeConnection, server_fds[i].get(), o.response_bytes);
    threads.emplace_back(RunClient, client_fds[i].get(), std::cref(o), from, end, &calls);
  }
  // Client threads end at `end`; their closed sockets end the server threads.
  for (size_t i = 1; i < threads.size(); i += 2) threads[i].join();
  for (Fd& fd : client_fds) ::shutdown(fd.get(), SHUT_RDWR);
  for (size_t i = 0; i < threads.size(); i += 2) threads[i].join();
  TcpCeilingResult r;
  r.calls = calls.load();
  r.seconds = o.seconds;
  return r;
}

}  // namespace attn::client
