#include "attn/client/async_client.h"

#include <grpcpp/support/byte_buffer.h>

#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attn/client/wire_coding.h"
#include "grpc_hand_off.h"

namespace attn::client {
namespace internal {

// One unary call, alive until its callback has returned. It ends when two things have happened,
// in either order: gRPC completed the call, and gRPC let go of every slice over the caller's
// tensors. Whichever comes last reads the response and runs the caller's callback.
//
// Ownership: the call holds itself (self_) from Start until it ends; AsyncCall handles share it.
class AsyncUnaryCall : public std::enable_shared_from_this<AsyncUnaryCall> {
 public:
  // Reads the response (when status is OK) and calls the caller's callback.
  using Finish = std::function<void(const grpc::Status&, grpc::ByteBuffer*)>;

  AsyncUnaryCall(AsyncClient* owner, Finish finish) : owner_(owner), finish_(std::move(finish)) {}

  grpc::ClientContext* context() { return ctx_.get(); }
  BorrowedSlices* borrowed() { return &borrowed_; }
  void set_request(grpc::ByteBuffer request) { request_ = std::move(request); }
  // What the request's tensors lie in, when the call owns it: kept until the call ends.
  void Keep(std::shared_ptr<const void> owned) { owned_ = std::move(owned); }

  void Start(Client& client, Client::RawMethod method) {
    self_ = shared_from_this();
    owner_->Started();
    client.StartRawCall(method, ctx_.get(), &request_, &response_, [this](grpc::Status st) {
      status_ = std::move(st);
      // The context holds the call, and the call may hold the request's slices (a cancelled
      // call, a retry's buffer) until it goes: both go now, and our own references with them.
      std::unique_ptr<grpc::ClientContext> ctx;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ctx = std::move(ctx_);
      }
      ctx.reset();
      request_.Clear();
      Arrive();
    });
    borrowed_.NotifyWhenReleased([this] { Arrive(); });
  }

  void Cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx_ != nullptr) ctx_->TryCancel();
  }

 private:
  void Arrive() {
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    finish_(status_, &response_);
    AsyncClient* owner = owner_;
    // Last: may destroy this call (when no handle holds it).
    std::shared_ptr<AsyncUnaryCall> self = std::move(self_);
    self.reset();
    owner->Ended();
  }

  AsyncClient* const owner_;
  Finish finish_;
  std::mutex mu_;
  std::unique_ptr<grpc::ClientContext> ctx_ = std::make_unique<grpc::ClientContext>();  // mu_
  grpc::ByteBuffer request_, response_;
  grpc::Status status_;
  std::atomic<int> pending_{2};  // the call's completion, the slices' release
  std::shared_ptr<AsyncUnaryCall> self_;
  std::shared_ptr<const void> owned_;
  // Last member, so destroyed first: its destructor must not wait on anything of the above.
  BorrowedSlices borrowed_;
};

}  // namespace internal

using internal::AsyncUnaryCall;

void AsyncCall::Cancel() const {
  if (call_) call_->Cancel();
}

absl::StatusOr<std::unique_ptr<AsyncClient>> AsyncClient::Create(const ClientOptions& options) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) return client.status();
  return std::make_unique<AsyncClient>(std::shared_ptr<Client>(std::move(*client)));
}

AsyncClient::AsyncClient(std::shared_ptr<Client> client) : client_(std::move(client)) {}

AsyncClient::~AsyncClient() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return in_flight_ == 0; });
}

void AsyncClient::Started() {
  std::lock_guard<std::mutex> lock(mu_);
  ++in_flight_;
}

void AsyncClient::Ended() {
  // Notified under the lock: the destructor cannot return (and mu_ go) before this is done.
  std::lock_guard<std::mutex> lock(mu_);
  if (--in_flight_ == 0) idle_.notify_all();
}

int64_t AsyncClient::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

namespace {

// A callback that fulfils promise.
template <typename T>
AsyncCallback<T> Fulfil(std::shared_ptr<std::promise<absl::StatusOr<T>>> promise) {
  return [promise = std::move(promise)](absl::StatusOr<T> r) { promise->set_value(std::move(r)); };
}

}  // namespace

AsyncCall AsyncClient::StartAttend(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const AttendOptions& options, std::shared_ptr<const void> owned,
                                   AsyncCallback<AttendResult> done) {
  auto call = std::make_shared<AsyncUnaryCall>(
      this, [done = std::move(done)](const grpc::Status& st, grpc::ByteBuffer* response) {
        if (!st.ok()) return done(FromGrpc(st));
        done(AttendResultFromWire(response));
      });
  client_->PrepareContext(call->context(), options.timeout);
  call->set_request(EncodeAttendRequest(q, k, v, options, call->borrowed()));
  call->Keep(std::move(owned));
  call->Start(*client_, Client::RawMethod::kAttend);
  return AsyncCall(std::move(call));
}

AsyncCall AsyncClient::Attend(const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttendOptions& options, AsyncCallback<AttendResult> done) {
  return StartAttend(q, k, v, options, nullptr, std::move(done));
}

AsyncCall AsyncClient::Attend(Tensor&& q, Tensor&& k, Tensor&& v, const AttendOptions& options,
                              AsyncCallback<AttendResult> done) {
  auto owned = std::make_shared<const std::array<Tensor, 3>>(
      std::array<Tensor, 3>{std::move(q), std::move(k), std::move(v)});
  const std::array<Tensor, 3>& t = *owned;
  return StartAttend(t[0], t[1], t[2], options, std::move(owned), std::move(done));
}

std::future<absl::StatusOr<AttendResult>> AsyncClient::Attend(const Tensor& q, const Tensor& k,
                                                              const Tensor& v,
                                                              const AttendOptions& options) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<AttendResult>>>();
  std::future<absl::StatusOr<AttendResult>> future = promise->get_future();
  Attend(q, k, v, options, Fulfil(std::move(promise)));
  return future;
}

std::future<absl::StatusOr<AttendResult>> AsyncClient::Attend(Tensor&& q, Tensor&& k, Tensor&& v,
                                                              const AttendOptions& options) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<AttendResult>>>();
  std::future<absl::StatusOr<AttendResult>> future = promise->get_future();
  Attend(std::move(q), std::move(k), std::move(v), options, Fulfil(std::move(promise)));
  return future;
}

AsyncCall AsyncClient::StartStep(const StepInput& in, std::chrono::milliseconds timeout,
                                 std::shared_ptr<const void> owned,
                                 AsyncCallback<StepResult> done) {
  auto call = std::make_shared<AsyncUnaryCall>(
      this, [done = std::move(done)](const grpc::Status& st, grpc::ByteBuffer* response) {
        if (!st.ok()) return done(FromGrpc(st));
        done(StepResultFromWire(response));
      });
  client_->PrepareContext(call->context(), timeout);
  call->set_request(EncodeStepRequest(in, call->borrowed()));
  call->Keep(std::move(owned));
  call->Start(*client_, Client::RawMethod::kStep);
  return AsyncCall(std::move(call));
}

AsyncCall AsyncClient::Step(const StepInput& in, std::chrono::milliseconds timeout,
                            AsyncCallback<StepResult> done) {
  return StartStep(in, timeout, nullptr, std::move(done));
}

AsyncCall AsyncClient::Step(StepInput&& in, std::chrono::milliseconds timeout,
                            AsyncCallback<StepResult> done) {
  auto owned = std::make_shared<const StepInput>(std::move(in));
  const StepInput& kept = *owned;
  return StartStep(kept, timeout, std::move(owned), std::move(done));
}

std::future<absl::StatusOr<StepResult>> AsyncClient::Step(const StepInput& in,
                                                          std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<StepResult>>>();
  std::future<absl::StatusOr<StepResult>> future = promise->get_future();
  Step(in, timeout, Fulfil(std::move(promise)));
  return future;
}

std::future<absl::StatusOr<StepResult>> AsyncClient::Step(StepInput&& in,
                                                          std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<StepResult>>>();
  std::future<absl::StatusOr<StepResult>> future = promise->get_future();
  Step(std::move(in), timeout, Fulfil(std::move(promise)));
  return future;
}

AsyncCall AsyncClient::StartBatchStep(const std::vector<StepInput>& items,
                                      std::chrono::milliseconds timeout,
                                      std::shared_ptr<const void> owned,
                                      AsyncCallback<BatchStepResults> done) {
  auto call = std::make_shared<AsyncUnaryCall>(
      this, [done = std::move(done), n = items.size()](const grpc::Status& st,
                                                      grpc::ByteBuffer* response) {
        if (!st.ok()) return done(FromGrpc(st));
        done(BatchStepResultsFromWire(response, n));
      });
  client_->PrepareContext(call->context(), timeout);
  call->set_request(EncodeBatchStepRequest(items, nullptr, call->borrowed()));
  call->Keep(std::move(owned));
  call->Start(*client_, Client::RawMethod::kBatchStep);
  return AsyncCall(std::move(call));
}

AsyncCall AsyncClient::BatchStep(const std::vector<StepInput>& items,
                                 std::chrono::milliseconds timeout,
                                 AsyncCallback<BatchStepResults> done) {
  return StartBatchStep(items, timeout, nullptr, std::move(done));
}

AsyncCall AsyncClient::BatchStep(std::vector<StepInput>&& items, std::chrono::milliseconds timeout,
                                 AsyncCallback<BatchStepResults> done) {
  auto owned = std::make_shared<const std::vector<StepInput>>(std::move(items));
  const std::vector<StepInput>& kept = *owned;
  return StartBatchStep(kept, timeout, std::move(owned), std::move(done));
}

AsyncCall AsyncClient::Echo(std::string_view payload, AsyncCallback<std::string> done) {
  auto call = std::make_shared<AsyncUnaryCall>(
      this, [done = std::move(done)](const grpc::Status& st, grpc::ByteBuffer* response) {
        if (!st.ok()) return done(FromGrpc(st));
        done(EchoPayloadFromWire(response));
      });
  client_->PrepareContext(call->context(), std::chrono::milliseconds(60000));
  call->set_request(EncodeEchoRequest(payload, 0, call->borrowed()));
  call->Start(*client_, Client::RawMethod::kEcho);
  return AsyncCall(std::move(call));
}

// ---- AttendPipeline -----------------------------------------------------------------------------

// The stream's reactor. Writes go out one at a time from a queue (a reactor has at most one
// write in flight); a read is always posted. Each request is copied once into the message it is
// written as: gRPC keeps the slices of a stream's written messages until the stream ends, so
// borrowed ones would pin the callers' tensors for the stream's whole life.
//
// Ownership: the Stream holds itself (self_) from Open until gRPC's OnDone, and the pipeline
// shares it; items_ owns the items until they are answered. A hold (AddHold) keeps the stream
// open for writes started from callers' threads until Finish, or until the stream can take no
// more.
class AttendPipeline::Stream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                               public std::enable_shared_from_this<Stream> {
 public:
  Stream(AsyncClient* owner, const Options& options) : owner_(owner), options_(options) {}

  void Open() {
    self_ = shared_from_this();
    owner_->client().PrepareContext(ctx_.get(), options_.timeout);
    owner_->client().PrepareRawAttendStream(ctx_.get(), this);
    AddHold();
    internal::HandOffToGrpc(this);
    StartRead(&read_buffer_);
    StartCall();
  }

  absl::Status Submit(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttendOptions& options, AsyncCallback<AttendResult> done) {
    std::unique_lock<std::mutex> lock(mu_);
    slot_free_.wait(lock, [&] {
      return static_cast<int>(items_.size()) < options_.depth || !open_for_writes_;
    });
    if (done_ && !final_status_.ok()) return FromGrpc(final_status_);
    if (!open_for_writes_) {
      return absl::FailedPreconditionError(
          "this AttendPipeline's stream is finished or ended; open another");
    }
    const uint64_t id = next_id_++;
    auto item = std::make_shared<Item>();
    item->done = std::move(done);
    item->request = CopiedAttendRequest(q, k, v, options, id);
    items_.emplace(id, item);
    queue_.push_back(id);
    MaybeWriteLocked();
    return absl::OkStatus();
  }

  absl::Status Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      MaybeWriteLocked();
    }
    std::unique_lock<std::mutex> lock(mu_);
    finished_.wait(lock, [&] { return done_ && items_.empty(); });
    return FromGrpc(final_status_);
  }

  void Cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx_ != nullptr) ctx_->TryCancel();
  }

  int in_flight() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(items_.size());
  }

  // gRPC's reactions: they never block (mu_ is only held briefly).
  void OnWriteDone(bool ok) override {
    internal::TakeBackFromGrpc(this);
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    write_buffer_.Clear();
    if (ok) return MaybeWriteLocked();
    // The stream broke: nothing more is written, and OnDone will come with its status.
    CloseForWritesLocked();
  }

  void OnReadDone(bool ok) override {
    internal::TakeBackFromGrpc(this);
    if (!ok) {
      // The server ended the stream: no more answers, so no more writes either.
      std::lock_guard<std::mutex> lock(mu_);
      CloseForWritesLocked();
      return;
    }
    ReceivedBytes received;
    DecodedAttendResponse decoded;
    absl::Status st = received.Take(&read_buffer_);
    if (st.ok()) st = DecodeAttendResponse(received.pieces, &decoded);
    if (!st.ok()) {
      // An answer that cannot be read cannot be matched to its item: end the stream.
      Cancel();
      return;
    }
    Answer(decoded);
    internal::HandOffToGrpc(this);
    StartRead(&read_buffer_);
  }

  void OnDone(const grpc::Status& status) override {
    internal::TakeBackFromGrpc(this);
    std::vector<std::pair<uint64_t, std::shared_ptr<Item>>> unanswered;
    std::unique_ptr<grpc::ClientContext> ctx;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The context holds the call, which may hold written requests' slices: it goes now.
      ctx = std::move(ctx_);
      final_status_ = status;
      done_ = true;
      open_for_writes_ = false;
      for (auto& [id, item] : items_) {
        if (!item->answered) unanswered.emplace_back(id, item);
      }
      slot_free_.notify_all();
    }
    ctx.reset();
    const absl::Status failed =
        status.ok() ? absl::InternalError("the AttendStream ended before this item was answered")
                    : FromGrpc(status);
    for (auto& [id, item] : unanswered) {
      item->result = failed;
      End(id, item);
    }
    std::shared_ptr<Stream> self;
    std::lock_guard<std::mutex> lock(mu_);
    if (items_.empty()) finished_.notify_all();
    self = std::move(self_);  // released after the lock: the pipeline may still hold the stream
  }

 private:
  struct Item {
    grpc::ByteBuffer request;
    AsyncCallback<AttendResult> done;
    absl::StatusOr<AttendResult> result = absl::UnknownError("unanswered");
    bool written = false;   // handed to gRPC (mu_)
    bool answered = false;  // its answer came, or the stream ended without one (reactions only)
  };

  // The request as EncodeAttendRequest writes it, its tensors copied into slices of its own.
  static grpc::ByteBuffer CopiedAttendRequest(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const AttendOptions& options, uint64_t id) {
    BorrowedSlices borrowed;
    grpc::ByteBuffer encoded = EncodeAttendRequest(q, k, v, options, &borrowed, id);
    std::vector<grpc::Slice> slices;
    (void)encoded.Dump(&slices);
    std::vector<grpc::Slice> copies;
    copies.reserve(slices.size());
    for (const grpc::Slice& slice : slices) copies.emplace_back(slice.begin(), slice.size());
    return grpc::ByteBuffer(copies.data(), copies.size());
  }

  // The answer's item, if it is one of ours still waiting (a repeated or unknown id is dropped).
  void Answer(const DecodedAttendResponse& decoded) {
    const uint64_t id = decoded.header.request_id();
    std::shared_ptr<Item> item;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = items_.find(id);
      if (it == items_.end() || it->second->answered || !it->second->written) return;
      item = it->second;
    }
    item->answered = true;
    if (decoded.header.status_code() != 0) {
      item->result = absl::Status(static_cast<absl::StatusCode>(decoded.header.status_code()),
                                  decoded.header.status_message());
    } else {
      AttendResult result;
      absl::Status read = ReadAttendResult(decoded, &result);
      if (read.ok()) {
        item->result = std::move(result);
      } else {
        item->result = read;
      }
    }
    End(id, item);
  }

  // Writes the next queued request when no write is in flight; half-closes once closing and all
  // is written. mu_ held.
  void MaybeWriteLocked() {
    if (writing_ || !open_for_writes_) return;
    while (!queue_.empty()) {
      const uint64_t id = queue_.front();
      queue_.pop_front();
      auto it = items_.find(id);
      if (it == items_.end()) continue;
      Item& item = *it->second;
      item.written = true;
      writing_ = true;
      write_buffer_ = std::move(item.request);
      internal::HandOffToGrpc(this);
      StartWrite(&write_buffer_);
      return;
    }
    if (closing_) {
      internal::HandOffToGrpc(this);
      StartWritesDone();
      CloseForWritesLocked();
    }
  }

  // No write starts after this; gRPC may then end the stream (OnDone). mu_ held.
  void CloseForWritesLocked() {
    if (!open_for_writes_) return;
    open_for_writes_ = false;
    slot_free_.notify_all();
    RemoveHold();
  }

  // Runs the item's callback and lets the item go.
  void End(uint64_t id, const std::shared_ptr<Item>& item) {
    item->done(std::move(item->result));
    std::lock_guard<std::mutex> lock(mu_);
    items_.erase(id);
    slot_free_.notify_all();
    if (items_.empty()) finished_.notify_all();
  }

  AsyncClient* const owner_;
  const Options options_;
  grpc::ByteBuffer read_buffer_, write_buffer_;

  mutable std::mutex mu_;
  std::condition_variable slot_free_, finished_;
  std::map<uint64_t, std::shared_ptr<Item>> items_;  // submitted, not yet ended
  std::deque<uint64_t> queue_;                        // submitted, not yet written
  uint64_t next_id_ = 1;
  bool writing_ = false;
  bool closing_ = false;          // Finish was called
  bool open_for_writes_ = true;   // the hold is held: writes may start
  bool done_ = false;             // OnDone ran
  grpc::Status final_status_;
  std::unique_ptr<grpc::ClientContext> ctx_ = std::make_unique<grpc::ClientContext>();
  std::shared_ptr<Stream> self_;
};

absl::StatusOr<std::unique_ptr<AttendPipeline>> AttendPipeline::Open(AsyncClient& client,
                                                                     const Options& options) {
  if (options.depth < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("AttendPipeline depth must be at least 1, got ", options.depth));
  }
  auto stream = std::make_shared<Stream>(&client, options);
  stream->Open();
  return std::unique_ptr<AttendPipeline>(new AttendPipeline(std::move(stream)));
}

AttendPipeline::~AttendPipeline() { stream_->Finish().IgnoreError(); }

absl::Status AttendPipeline::Submit(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttendOptions& options,
                                    AsyncCallback<AttendResult> done) {
  return stream_->Submit(q, k, v, options, std::move(done));
}

absl::Status AttendPipeline::Finish() { return stream_->Finish(); }

void AttendPipeline::Cancel() { stream_->Cancel(); }

int AttendPipeline::in_flight() const { return stream_->in_flight(); }

}  // namespace attn::client
