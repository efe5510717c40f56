// The attn.v1.SharedMemory service: register, unregister and list a client's shared-memory
// regions (see attention.proto). Each call is quick and answered on gRPC's thread.
#pragma once

#include <string>

#include "attn/v1/attention.grpc.pb.h"
#include "rpc/auth.h"

namespace attn {

class RegionRegistry;

class RegionService final : public v1::SharedMemory::CallbackService {
 public:
  // registry null: shared memory is off and every call gets FAILED_PRECONDITION. authenticator
  // null: no bearer tokens (the identity is the peer host). Both must outlive the service.
  RegionService(RegionRegistry* registry, const Authenticator* authenticator,
                std::string socket_path)
      : registry_(registry), authenticator_(authenticator), socket_path_(std::move(socket_path)) {}

  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const v1::RegisterRegionRequest* request,
                                           v1::RegisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const v1::UnregisterRegionRequest* request,
                                             v1::UnregisterRegionResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const v1::ListRegionsRequest* request,
                                        v1::ListRegionsResponse* response) override;

 private:
  // The caller's identity, or why the call is refused (no valid token, shared memory off).
  absl::StatusOr<std::string> Admit(const grpc::CallbackServerContext* ctx) const;
  static grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* ctx, const absl::Status& st);

  RegionRegistry* const registry_;
  const Authenticator* const authenticator_;
  const std::string socket_path_;
};

}  // namespace attn
