#include "attn/client/region_client.h"

#include <grpcpp/channel.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attn::client {
namespace {

// attnd's server/transport/region_socket.h
constexpr char kMemfdMagic[] = "ATTNFD01";
constexpr char kVmmMagic[] = "ATTNVM01";

absl::StatusOr<int> ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("bad region socket path '", path, "'"));
  }
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat(
        "cannot connect to attnd's region socket ", path, ": ", err,
        " (shared memory works only on attnd's host, as attnd's user)"));
  }
  return fd;
}

v1::DType Wire(DType t) {
  switch (t) {
    case DType::kFloat32: return v1::DTYPE_FLOAT32;
    case DType::kFloat16: return v1::DTYPE_FLOAT16;
    case DType::kFloat8E4M3: return v1::DTYPE_FLOAT8_E4M3;
    case DType::kBFloat16: return v1::DTYPE_BFLOAT16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionClient>> RegionClient::Connect(Client* client) {
  auto stub = v1::SharedMemory::NewStub(client->channel());
  v1::ListRegionsResponse list;
  grpc::ClientContext ctx;
  client->PrepareContext(&ctx, std::chrono::milliseconds(10000));
  const grpc::Status st = stub->ListRegions(&ctx, v1::ListRegionsRequest(), &list);
  if (!st.ok()) return FromGrpc(st);
  absl::StatusOr<int> fd = ConnectUnix(list.socket_path());
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<RegionClient>(new RegionClient(client, *fd, std::move(stub)));
}

RegionClient::~RegionClient() { ::close(socket_fd_); }

absl::StatusOr<std::string> RegionClient::Lease() {
  std::lock_guard<std::mutex> lock(socket_mu_);
  if (::send(socket_fd_, "ATTNLS01", 8, MSG_NOSIGNAL) != 8) {
    return absl::UnavailableError(absl::StrCat("region socket: ", std::strerror(errno)));
  }
  return ReadAnswer();
}

absl::StatusOr<std::string> RegionClient::ReadAnswer() {
  char answer[512];
  const ssize_t n = ::recv(socket_fd_, answer, sizeof(answer) - 1, 0);
  if (n <= 0) return absl::UnavailableError("region socket closed by attnd");
  std::string line(answer, static_cast<size_t>(n));
  while (!line.empty() && line.back() == '\n') line.pop_back();
  if (line.rfind("OK ", 0) == 0) return line.substr(3);
  return absl::InvalidArgumentError(
      absl::StrCat("attnd refused: ", line.rfind("ERR ", 0) == 0 ? line.substr(4) : line));
}

absl::StatusOr<std::string> RegionClient::SendDescriptor(int fd) {
  return SendWithFd(kMemfdMagic, fd);
}

absl::StatusOr<std::string> RegionClient::SendVmmDescriptor(int fd) {
  return SendWithFd(kVmmMagic, fd);
}

absl::StatusOr<std::string> RegionClient::SendWithFd(const char* magic, int fd) {
  std::lock_guard<std::mutex> lock(socket_mu_);
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{const_cast<char*>(magic), 8};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (::sendmsg(socket_fd_, &msg, MSG_NOSIGNAL) != 8) {
    return absl::UnavailableError(absl::StrCat("region socket: ", std::strerror(errno)));
  }
  return ReadAnswer();
}

absl::StatusOr<v1::RegionInfo> RegionClient::Register(const std::string& name,
                                                      const HostRegion& region) {
  absl::StatusOr<std::string> handle = SendDescriptor(region.fd());
  if (!handle.ok()) return handle.status();
  v1::RegisterRegionRequest request;
  request.set_name(name);
  request.set_kind(v1::REGION_KIND_HOST);
  request.set_handle(*handle);
  return RegisterRegion(request);
}

absl::StatusOr<v1::RegionInfo> RegionClient::RegisterRegion(
    const v1::RegisterRegionRequest& request) {
  v1::RegisterRegionResponse response;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(10000));
  const grpc::Status st = stub_->RegisterRegion(&ctx, request, &response);
  if (!st.ok()) return FromGrpc(st);
  return response.region();
}

absl::StatusOr<v1::RegionInfo> RegionClient::RegisterCudaVmm(const std::string& name, int fd,
                                                             int32_t device_id, uint64_t bytes) {
  absl::StatusOr<std::string> handle = SendVmmDescriptor(fd);
  if (!handle.ok()) return handle.status();
  v1::RegisterRegionRequest request;
  request.set_name(name);
  request.set_kind(v1::REGION_KIND_CUDA_VMM);
  request.set_handle(*handle);
  request.set_device_id(device_id);
  request.set_bytes(bytes);
  return RegisterRegion(request);
}

absl::StatusOr<v1::RegionInfo> RegionClient::RegisterCuda(const std::string& name,
                                                          const std::string& ipc_handle,
                                                          int32_t device_id, uint64_t bytes) {
  absl::StatusOr<std::string> lease = Lease();
  if (!lease.ok()) return lease.status();
  v1::RegisterRegionRequest request;
  request.set_name(name);
  request.set_kind(v1::REGION_KIND_CUDA);
  request.set_handle(*lease);
  request.set_cuda_ipc_handle(ipc_handle);
  request.set_device_id(device_id);
  request.set_bytes(bytes);
  return RegisterRegion(request);
}

absl::Status RegionClient::Unregister(const std::string& name) {
  v1::UnregisterRegionRequest request;
  request.set_name(name);
  v1::UnregisterRegionResponse response;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(10000));
  return FromGrpc(stub_->UnregisterRegion(&ctx, request, &response));
}

absl::StatusOr<v1::ListRegionsResponse> RegionClient::List() {
  v1::ListRegionsResponse response;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx, std::chrono::milliseconds(10000));
  const grpc::Status st = stub_->ListRegions(&ctx, v1::ListRegionsRequest(), &response);
  if (!st.ok()) return FromGrpc(st);
  return response;
}

v1::RegionSlice RegionSliceOf(const std::string& region, uint64_t offset, uint64_t bytes) {
  v1::RegionSlice s;
  s.set_region(region);
  s.set_offset(offset);
  s.set_bytes(bytes);
  return s;
}

v1::Tensor RegionTensor(DType dtype, const std::vector<int64_t>& shape, const std::string& region,
                        uint64_t offset) {
  v1::Tensor t;
  t.set_dtype(Wire(dtype));
  uint64_t bytes = DTypeBytes(dtype);
  for (int64_t s : shape) {
    t.add_shape(s);
    bytes *= static_cast<uint64_t>(s);
  }
  *t.mutable_region() = RegionSliceOf(region, offset, bytes);
  return t;
}

}  // namespace attn::client
