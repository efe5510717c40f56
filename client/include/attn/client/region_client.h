// Same-host shared memory with attnd (started with --allow_shared_memory): registers a client's
// host regions and builds request tensors that point into them instead of carrying their bytes.
//
//   auto regions = RegionClient::Connect(client.get());
//   auto region = HostRegion::Create(bytes);
//   (*regions)->Register("inputs", **region);
//   request.mutable_q()->... = RegionTensor(DType::kBFloat16, {s, h, d}, "inputs", 0);
//
// The RegionClient holds a connection to attnd's region socket: attnd drops this client's
// regions when it closes (on destruction, or when the process exits).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/client/client.h"
#include "attn/client/host_region.h"
#include "attn/v1/attention.grpc.pb.h"

namespace attn::client {

class RegionClient {
 public:
  // Asks client's server for its region socket (ListRegions) and connects to it.
  // FAILED_PRECONDITION when the server does not allow shared memory. client must outlive this.
  static absl::StatusOr<std::unique_ptr<RegionClient>> Connect(Client* client);
  ~RegionClient();

  // Passes region's memfd to attnd and registers it under name.
  absl::StatusOr<v1::RegionInfo> Register(const std::string& name, const HostRegion& region);
  // Registers GPU memory (on attnd's device) under name: ipc_handle is the 64 bytes of the
  // cudaIpcMemHandle_t of a cudaMalloc allocation made by this process, bytes its size. The
  // memory must stay allocated until it is unregistered. Tied to this object's socket by a
  // lease: attnd drops it when the socket closes.
  absl::StatusOr<v1::RegionInfo> RegisterCuda(const std::string& name,
                                              const std::string& ipc_handle, int32_t device_id,
                                              uint64_t bytes);
  // Registers GPU memory (on attnd's device) allocated with the CUDA virtual memory API under
  // name: fd is the POSIX file descriptor of a cuMemCreate allocation, from
  // cuMemExportToShareableHandle (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR); attnd gets a copy of
  // it over the socket and the caller keeps (and closes) its own. bytes: the size to map, at most
  // the allocation's. attnd drops it when this object's socket closes.
  absl::StatusOr<v1::RegionInfo> RegisterCudaVmm(const std::string& name, int fd,
                                                 int32_t device_id, uint64_t bytes);
  absl::Status Unregister(const std::string& name);
  absl::StatusOr<v1::ListRegionsResponse> List();

  // The first step of Register alone: hands fd to attnd over the socket and returns the
  // one-time handle (for callers that drive RegisterRegion themselves, and tests).
  absl::StatusOr<std::string> SendDescriptor(int fd);
  // The same for the descriptor of a CUDA VMM allocation (RegisterCudaVmm's first step).
  absl::StatusOr<std::string> SendVmmDescriptor(int fd);
  // A lease (a handle that ties a GPU region registered with it to this socket).
  absl::StatusOr<std::string> Lease();
  v1::SharedMemory::Stub* stub() { return stub_.get(); }

 private:
  RegionClient(Client* client, int socket_fd, std::unique_ptr<v1::SharedMemory::Stub> stub)
      : client_(client), socket_fd_(socket_fd), stub_(std::move(stub)) {}

  // Sends the 8 bytes `magic` with fd as SCM_RIGHTS and reads the answer.
  absl::StatusOr<std::string> SendWithFd(const char* magic, int fd);
  absl::StatusOr<v1::RegionInfo> RegisterRegion(const v1::RegisterRegionRequest& request);
  // The socket's one-line answer: the handle after "OK ", or the reason after "ERR ".
  absl::StatusOr<std::string> ReadAnswer();

  Client* const client_;
  const int socket_fd_;
  std::unique_ptr<v1::SharedMemory::Stub> stub_;
  std::mutex socket_mu_;  // one descriptor and its answer at a time
};

// A slice of a region: bytes at offset of the region named region. attnd takes only offsets that
// are multiples of the element size (2 for float16/bfloat16, 4 for float32 and lse).
v1::RegionSlice RegionSliceOf(const std::string& region, uint64_t offset, uint64_t bytes);
// A request tensor whose elements lie in a region at offset (its byte size from shape and dtype;
// offset a multiple of the element size).
v1::Tensor RegionTensor(DType dtype, const std::vector<int64_t>& shape, const std::string& region,
                        uint64_t offset);

}  // namespace attn::client
