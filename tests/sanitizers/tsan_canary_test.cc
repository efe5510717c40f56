// Proof that tsan.supp and scripts/tsan_triage.py leave races in our own code visible: a callback
// service whose Echo handler bumps a counter with no lock, called from several client threads,
// while the test thread bumps it too. Built only with ATTN_SANITIZE=thread; its
// ctest (tsan_canary.sh) passes only when that race is reported as attnd's own.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "attn/v1/attention.grpc.pb.h"

namespace attn {
namespace {

long unsynchronized_calls = 0;  // the deliberate race

class CanaryService final : public v1::Attention::CallbackService {
  grpc::ServerUnaryReactor* Echo(grpc::CallbackServerContext* ctx, const v1::EchoRequest* request,
                                 v1::EchoResponse* response) override {
    ++unsynchronized_calls;
    response->set_payload(request->payload());
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(TsanCanary, RaceInAHandlerIsReported) {
  CanaryService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto channel =
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials());
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      auto stub = v1::Attention::NewStub(channel);
      for (int i = 0; i < 20; ++i) {
        grpc::ClientContext ctx;
        v1::EchoRequest req;
        v1::EchoResponse resp;
        req.set_payload("x");
        EXPECT_TRUE(stub->Echo(&ctx, req, &resp).ok());
      }
    });
  }
  // gRPC may run a handler on a client thread that is polling, which the join below orders
  // before this thread; this write, between creating the clients and joining them, races with
  // the handlers' writes on whichever thread gRPC runs them.
  ++unsynchronized_calls;
  for (auto& t : clients) t.join();
  EXPECT_GT(unsynchronized_calls, 1);
  server->Shutdown();
}

}  // namespace
}  // namespace attn
