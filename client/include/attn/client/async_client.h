// The asynchronous C++ client of attnd: Attend, Step and BatchStep that return at once and
// complete through a callback (or a std::future), over gRPC's callback API and the same one-copy
// wire coding as Client (attn/client/wire_coding.h); and AttendPipeline, which keeps up to N
// Attend requests in flight on one AttendStream.
//
// Buffers: a call given tensors the caller keeps (lvalues) borrows their bytes (no copy): they
// must stay valid and unchanged until the call's callback has started (or its future is ready).
// The callback runs only once the call is complete AND gRPC has let go of every slice over them.
// A call given temporaries (rvalues: StepInput{...}, std::move(q)) keeps them itself until then.
//
// Threads: callbacks run on gRPC's threads. They must not block for long (a blocked callback
// holds one of gRPC's few callback threads); hand heavy work to a thread of your own.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "attn/client/client.h"
#include "attn/client/session.h"

namespace attn::client {

template <typename T>
using AsyncCallback = std::function<void(absl::StatusOr<T>)>;

namespace internal {
class AsyncUnaryCall;
}  // namespace internal

// A call in flight. Cancel() asks gRPC to cancel it: its callback then gets CANCELLED, unless the
// call had completed already. Copies refer to the same call; a default-constructed one to none.
class AsyncCall {
 public:
  AsyncCall() = default;
  void Cancel() const;

 private:
  friend class AsyncClient;
  explicit AsyncCall(std::shared_ptr<internal::AsyncUnaryCall> call) : call_(std::move(call)) {}
  std::shared_ptr<internal::AsyncUnaryCall> call_;
};

class AsyncClient {
 public:
  static absl::StatusOr<std::unique_ptr<AsyncClient>> Create(const ClientOptions& options);
  // Over client's connections and settings (token, deadlines' defaults, retries, keepalive).
  explicit AsyncClient(std::shared_ptr<Client> client);
  // Waits until every call's callback has returned; cancels nothing.
  ~AsyncClient();
  AsyncClient(const AsyncClient&) = delete;
  AsyncClient& operator=(const AsyncClient&) = delete;

  AsyncCall Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                   const AttendOptions& options, AsyncCallback<AttendResult> done);
  AsyncCall Attend(Tensor&& q, Tensor&& k, Tensor&& v, const AttendOptions& options,
                   AsyncCallback<AttendResult> done);
  std::future<absl::StatusOr<AttendResult>> Attend(const Tensor& q, const Tensor& k,
                                                   const Tensor& v,
                                                   const AttendOptions& options = {});
  std::future<absl::StatusOr<AttendResult>> Attend(Tensor&& q, Tensor&& k, Tensor&& v,
                                                   const AttendOptions& options = {});

  // One step of a session on this client's endpoint (session.h's Step, without blocking). Steps
  // of one (session, layer) apply in the order attnd receives them: a caller that needs them in
  // its own order waits for each before sending the next.
  AsyncCall Step(const StepInput& in, std::chrono::milliseconds timeout,
                 AsyncCallback<StepResult> done);
  AsyncCall Step(StepInput&& in, std::chrono::milliseconds timeout,
                 AsyncCallback<StepResult> done);
  std::future<absl::StatusOr<StepResult>> Step(
      const StepInput& in, std::chrono::milliseconds timeout = kDefaultSessionTimeout);
  std::future<absl::StatusOr<StepResult>> Step(
      StepInput&& in, std::chrono::milliseconds timeout = kDefaultSessionTimeout);

  // The outer status is the RPC's; each item then has its own. One call, whatever its size
  // (session.h's blocking BatchStep cuts one larger than half of max_message_bytes into several):
  // a batch past the message limit fails as a whole with RESOURCE_EXHAUSTED.
  using BatchStepResults = std::vector<absl::StatusOr<StepResult>>;
  AsyncCall BatchStep(const std::vector<StepInput>& items, std::chrono::milliseconds timeout,
                      AsyncCallback<BatchStepResults> done);
  AsyncCall BatchStep(std::vector<StepInput>&& items, std::chrono::milliseconds timeout,
                      AsyncCallback<BatchStepResults> done);

  AsyncCall Echo(std::string_view payload, AsyncCallback<std::string> done);

  // Calls whose callbacks have not yet returned.
  int64_t in_flight() const;
  Client& client() { return *client_; }

 private:
  friend class internal::AsyncUnaryCall;
  // A call's start and end, for the destructor's wait.
  void Started();
  void Ended();
  // The calls, keeping `owned` (what the tensors lie in, or null) until they end.
  AsyncCall StartAttend(const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttendOptions& options, std::shared_ptr<const void> owned,
                        AsyncCallback<AttendResult> done);
  AsyncCall StartStep(const StepInput& in, std::chrono::milliseconds timeout,
                      std::shared_ptr<const void> owned, AsyncCallback<StepResult> done);
  AsyncCall StartBatchStep(const std::vector<StepInput>& items, std::chrono::milliseconds timeout,
                           std::shared_ptr<const void> owned,
                           AsyncCallback<BatchStepResults> done);

  std::shared_ptr<Client> client_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  int64_t in_flight_ = 0;  // guarded by mu_
};

// Keeps up to `depth` Attend requests in flight on one AttendStream (attnd pipelines them), each
// answered through its own callback in the order attnd finishes them. Submit blocks the caller
// while `depth` are in flight: the back-pressure of a producer loop. Not for use from a
// callback. Thread-safe.
class AttendPipeline {
 public:
  struct Options {
    int depth = 8;
    // Deadline of the whole stream; 0: none.
    std::chrono::milliseconds timeout{0};
  };
  // Opens the stream on the client's next connection. The client must outlive the pipeline.
  static absl::StatusOr<std::unique_ptr<AttendPipeline>> Open(AsyncClient& client,
                                                              const Options& options);
  // Finish()es (waits for every callback) if the caller has not.
  ~AttendPipeline();

  // Sends one request. Its tensors are copied once into the message (gRPC keeps the messages
  // written on a stream until the stream ends, so they cannot be borrowed): the caller may reuse
  // them as soon as Submit returns.
  // FAILED_PRECONDITION once the stream has ended or Finish was called; the stream's status when
  // it failed (then done is not called).
  absl::Status Submit(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttendOptions& options, AsyncCallback<AttendResult> done);
  // Half-closes the stream, waits for every answer and every callback, and returns the
  // stream's final status. Items still unanswered when the stream fails get its status.
  absl::Status Finish();
  // Cancels the stream: items in flight get CANCELLED.
  void Cancel();
  int in_flight() const;

 private:
  class Stream;
  explicit AttendPipeline(std::shared_ptr<Stream> stream) : stream_(std::move(stream)) {}
  std::shared_ptr<Stream> stream_;
};

}  // namespace attn::client
