#include "rpc/region_service.h"

#include "common/status_util.h"
#include "rpc/grpc_status.h"
#include "common/tsan_annotations.h"
#include "transport/region_registry.h"

namespace attn {

absl::StatusOr<std::string> RegionService::Admit(const grpc::CallbackServerContext* ctx) const {
  TakeBackFromGrpc(this);
  absl::StatusOr<std::string> who = authenticator_ != nullptr ? authenticator_->Authenticate(*ctx)
                                                              : PeerHost(ctx->peer());
  if (!who.ok()) return who;
  if (registry_ == nullptr) {
    return absl::FailedPreconditionError(
        "shared memory is off on this attnd (start it with --allow_shared_memory)");
  }
  return who;
}

grpc::ServerUnaryReactor* RegionService::Finish(grpc::CallbackServerContext* ctx,
                                                const absl::Status& st) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(st));
  return reactor;
}

grpc::ServerUnaryReactor* RegionService::RegisterRegion(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterRegionRequest* request,
                                                        v1::RegisterRegionResponse* response) {
  absl::StatusOr<std::string> who = Admit(ctx);
  if (!who.ok()) return Finish(ctx, who.status());
  absl::StatusOr<v1::RegionInfo> info = registry_->Register(*who, *request);
  if (info.ok()) *response->mutable_region() = std::move(*info);
  return Finish(ctx, info.status());
}

grpc::ServerUnaryReactor* RegionService::UnregisterRegion(
    grpc::CallbackServerContext* ctx, const v1::UnregisterRegionRequest* request,
    v1::UnregisterRegionResponse*) {
  absl::StatusOr<std::string> who = Admit(ctx);
  if (!who.ok()) return Finish(ctx, who.status());
  return Finish(ctx, registry_->Unregister(*who, request->name()));
}

grpc::ServerUnaryReactor* RegionService::ListRegions(grpc::CallbackServerContext* ctx,
                                                     const v1::ListRegionsRequest*,
                                                     v1::ListRegionsResponse* response) {
  absl::StatusOr<std::string> who = Admit(ctx);
  if (!who.ok()) return Finish(ctx, who.status());
  for (v1::RegionInfo& info : registry_->List(*who)) *response->add_regions() = std::move(info);
  response->set_socket_path(socket_path_);
  response->set_max_regions(registry_->options().max_regions_per_client);
  response->set_max_bytes(registry_->options().max_bytes_per_client);
  return Finish(ctx, absl::OkStatus());
}

}  // namespace attn
