// attn/client/c_api.h over attn::client::Client's raw calls.
#include "attn/client/c_api.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "attn/client/client.h"
#include "attn/client/wire_coding.h"

#define ATTN_C_EXPORT extern "C" __attribute__((visibility("default")))

struct attn_c_client {
  std::unique_ptr<attn::client::Client> client;
};

struct attn_c_response {
  grpc::ByteBuffer buffer;
  size_t size = 0;
};

namespace {

using attn::client::Client;
using attn::client::ClientOptions;

void WriteMessage(absl::string_view text, char* out, size_t out_size) {
  if (out == nullptr || out_size == 0) return;
  const size_t n = std::min(text.size(), out_size - 1);
  std::memcpy(out, text.data(), n);
  out[n] = '\0';
}

absl::Status ParseInt(absl::string_view key, absl::string_view value, int64_t* out) {
  if (!absl::SimpleAtoi(value, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat("setting ", key, ": expected an integer, got '", value, "'"));
  }
  return absl::OkStatus();
}

absl::Status ParseBool(absl::string_view key, absl::string_view value, bool* out) {
  if (value == "1" || value == "true") {
    *out = true;
  } else if (value == "0" || value == "false" || value.empty()) {
    *out = false;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("setting ", key, ": expected 0 or 1, got '", value, "'"));
  }
  return absl::OkStatus();
}

absl::Status ParseIntInRange(absl::string_view key, absl::string_view value, int64_t lo, int64_t hi,
                             int64_t* out) {
  if (absl::Status st = ParseInt(key, value, out); !st.ok()) return st;
  if (*out < lo || *out > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("setting ", key, ": ", *out, " is outside ", lo, "..", hi));
  }
  return absl::OkStatus();
}

absl::Status Apply(absl::string_view key, absl::string_view value, ClientOptions* o) {
  int64_t n = 0;
  if (key == "target") {
    o->target = std::string(value);
  } else if (key == "tls") {
    return ParseBool(key, value, &o->tls);
  } else if (key == "tls_ca_pem") {
    o->tls_ca_pem = std::string(value);
  } else if (key == "tls_cert_pem") {
    o->tls_cert_pem = std::string(value);
  } else if (key == "tls_key_pem") {
    o->tls_key_pem = std::string(value);
  } else if (key == "tls_server_name") {
    o->tls_server_name = std::string(value);
  } else if (key == "token") {
    o->bearer_token = std::string(value);
  } else if (key == "connections") {
    if (absl::Status st = ParseIntInRange(key, value, 1, 1024, &n); !st.ok()) return st;
    o->connections = static_cast<int>(n);
  } else if (key == "max_message_bytes") {
    if (absl::Status st = ParseIntInRange(key, value, 1, INT32_MAX, &n); !st.ok()) return st;
    o->max_message_bytes = n;
  } else if (key == "wait_for_ready") {
    return ParseBool(key, value, &o->wait_for_ready);
  } else if (key == "lb_policy") {
    o->lb_policy = std::string(value);
  } else if (key == "retry_max_attempts") {
    // Client::Create checks the range.
    if (absl::Status st = ParseIntInRange(key, value, INT32_MIN, INT32_MAX, &n); !st.ok()) return st;
    o->retry_max_attempts = static_cast<int>(n);
  } else if (key.substr(0, 4) == "arg:" && key.size() > 4) {
    if (absl::Status st = ParseIntInRange(key, value, INT32_MIN, INT32_MAX, &n); !st.ok()) return st;
    o->channel_args.emplace_back(std::string(key.substr(4)), static_cast<int>(n));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown setting '", key, "'"));
  }
  return absl::OkStatus();
}

bool MethodOf(absl::string_view name, Client::RawMethod* out) {
  if (name == "Attend") {
    *out = Client::RawMethod::kAttend;
  } else if (name == "Echo") {
    *out = Client::RawMethod::kEcho;
  } else if (name == "Step") {
    *out = Client::RawMethod::kStep;
  } else if (name == "BatchStep") {
    *out = Client::RawMethod::kBatchStep;
  } else {
    return false;
  }
  return true;
}

// A blocking call of the request make builds over borrowed slices (the caller's bytes go out in
// place); returns once gRPC has let go of them.
template <typename Make>
grpc::Status CallBorrowing(attn_c_client* client, Client::RawMethod method, int64_t timeout_ms,
                           Make make, grpc::ByteBuffer* response) {
  attn::client::BorrowedSlices borrowed;
  return client->client->CallUnary(method, make(&borrowed),
                                   std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
                                   response);
}

// A failed call's status code, its message written out.
int Failed(const absl::Status& st, char* message, size_t message_size) {
  WriteMessage(st.message(), message, message_size);
  return static_cast<int>(st.code());
}

int Failed(const grpc::Status& st, char* message, size_t message_size) {
  WriteMessage(st.error_message(), message, message_size);
  return static_cast<int>(st.error_code());
}

}  // namespace

ATTN_C_EXPORT int attn_c_abi_version(void) { return ATTN_C_ABI_VERSION; }

ATTN_C_EXPORT attn_c_client* attn_c_client_create(const char* const* keys,
                                                  const char* const* values, size_t n,
                                                  char* error, size_t error_size) {
  ClientOptions options;
  options.target.clear();
  options.retry_max_attempts = 1;  // bindings retry by their own rules
  for (size_t i = 0; i < n; ++i) {
    if (keys == nullptr || values == nullptr || keys[i] == nullptr || values[i] == nullptr) {
      WriteMessage("a setting's key or value is NULL", error, error_size);
      return nullptr;
    }
    if (absl::Status st = Apply(keys[i], values[i], &options); !st.ok()) {
      Failed(st, error, error_size);
      return nullptr;
    }
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) {
    Failed(client.status(), error, error_size);
    return nullptr;
  }
  return new attn_c_client{std::move(*client)};
}

ATTN_C_EXPORT void attn_c_client_destroy(attn_c_client* client) { delete client; }

namespace {

// Whether every part with bytes has data; else INVALID_ARGUMENT, who naming the function.
bool PartsValid(const char* who, const void* const* parts, const size_t* sizes, size_t n,
                char* message, size_t message_size) {
  for (size_t i = 0; i < n; ++i) {
    if (parts == nullptr || sizes == nullptr || (parts[i] == nullptr && sizes[i] > 0)) {
      WriteMessage(absl::StrCat(who, ": a part of the request is NULL"), message, message_size);
      return false;
    }
  }
  return true;
}

// The request of n parts, each borrowed (sent where it lies) through borrowed.
grpc::ByteBuffer BorrowParts(attn::client::BorrowedSlices* borrowed, const void* const* parts,
                             const size_t* sizes, size_t n) {
  std::vector<grpc::Slice> slices;  // released on return: the buffer holds its own references
  slices.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (sizes[i] > 0) slices.push_back(borrowed->Borrow(parts[i], sizes[i]));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace

ATTN_C_EXPORT int attn_c_call_parts(attn_c_client* client, const char* method,
                                    const void* const* parts, const size_t* sizes, size_t n,
                                    int64_t timeout_ms, attn_c_response** response, char* message,
                                    size_t message_size) {
  if (response != nullptr) *response = nullptr;
  Client::RawMethod raw{};
  if (client == nullptr || response == nullptr || method == nullptr || !MethodOf(method, &raw)) {
    WriteMessage(absl::StrCat("attn_c_call: ", client == nullptr ? "no client" :
                              response == nullptr ? "no response pointer" :
                              absl::StrCat("unknown method '", method ? method : "(null)", "'")),
                 message, message_size);
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  if (!PartsValid("attn_c_call", parts, sizes, n, message, message_size)) {
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto out = std::make_unique<attn_c_response>();
  const grpc::Status st = CallBorrowing(
      client, raw, timeout_ms,
      [&](attn::client::BorrowedSlices* borrowed) {
        return BorrowParts(borrowed, parts, sizes, n);
      },
      &out->buffer);
  if (!st.ok()) return Failed(st, message, message_size);
  out->size = out->buffer.Length();
  *response = out.release();
  return 0;
}

ATTN_C_EXPORT int attn_c_call(attn_c_client* client, const char* method, const void* request,
                              size_t request_size, int64_t timeout_ms, attn_c_response** response,
                              char* message, size_t message_size) {
  return attn_c_call_parts(client, method, &request, &request_size, 1, timeout_ms, response,
                           message, message_size);
}

namespace {

// Copies the pieces of a decoded output to dst, which must hold exactly their bytes.
absl::Status CopyOutput(const char* what, const std::vector<std::string_view>& pieces,
                        uint64_t size, void* dst, size_t dst_size) {
  if (size != dst_size) {
    return absl::InternalError(absl::StrCat("the server's StepResponse has ", size, " bytes of ",
                                            what, " where ", dst_size, " were expected"));
  }
  char* at = static_cast<char*>(dst);
  for (std::string_view p : pieces) {
    std::memcpy(at, p.data(), p.size());
    at += p.size();
  }
  return absl::OkStatus();
}

// A decoded StepResponse into the caller's outputs.
absl::Status WriteStepOutputs(const attn::client::DecodedStepResponse& decoded,
                              attn::v1::DType o_dtype, void* o, size_t o_size, void* lse,
                              size_t lse_size, int64_t* cached_tokens, void* timing,
                              size_t timing_capacity, size_t* timing_size) {
  const attn::v1::StepResponse& h = decoded.header;
  if (!h.has_o() || h.o().dtype() != o_dtype) {
    return absl::InternalError(absl::StrCat("the server's StepResponse has o of dtype ",
                                            h.o().dtype(), " where ", o_dtype, " was expected"));
  }
  if (absl::Status st = CopyOutput("o", decoded.o_data, decoded.o_size, o, o_size); !st.ok()) {
    return st;
  }
  if (lse != nullptr) {
    if (!h.has_lse() || h.lse().dtype() != attn::v1::DTYPE_FLOAT32) {
      return absl::InternalError("the server's StepResponse has no float32 lse");
    }
    if (absl::Status st = CopyOutput("lse", decoded.lse_data, decoded.lse_size, lse, lse_size);
        !st.ok()) {
      return st;
    }
  }
  if (cached_tokens != nullptr) *cached_tokens = h.cached_tokens();
  if (timing_size != nullptr) {
    const std::string t = h.timing().SerializeAsString();
    *timing_size = t.size() <= timing_capacity ? t.size() : 0;
    if (*timing_size > 0) std::memcpy(timing, t.data(), t.size());
  }
  return absl::OkStatus();
}

// A received StepResponse into the caller's outputs.
absl::Status ReadStepInto(grpc::ByteBuffer* response, attn::v1::DType o_dtype, void* o,
                          size_t o_size, void* lse, size_t lse_size, int64_t* cached_tokens,
                          void* timing, size_t timing_capacity, size_t* timing_size) {
  attn::client::ReceivedBytes received;
  if (absl::Status st = received.Take(response); !st.ok()) return st;
  attn::client::DecodedStepResponse decoded;
  if (absl::Status st = attn::client::DecodeStepResponse(received.pieces, &decoded); !st.ok()) {
    return st;
  }
  return WriteStepOutputs(decoded, o_dtype, o, o_size, lse, lse_size, cached_tokens, timing,
                          timing_capacity, timing_size);
}

// The references a step's arguments make (dtypes checked, data non-NULL where it has bytes);
// INVALID_ARGUMENT naming the tensor otherwise. who prefixes the message.
absl::Status StepRefOf(absl::string_view who, const int32_t dtypes[3],
                       const int64_t* const shapes[3], const void* const data[3],
                       const size_t sizes[3], attn::client::StepInputRef* in) {
  attn::client::TensorRef* refs[3] = {&in->q, &in->k_new, &in->v_new};
  const char* names[3] = {"q", "k_new", "v_new"};
  for (int i = 0; i < 3; ++i) {
    const auto dtype = attn::client::FromWireDType(static_cast<attn::v1::DType>(dtypes[i]));
    if (!dtype.ok() || (data[i] == nullptr && sizes[i] > 0)) {
      return absl::InvalidArgumentError(absl::StrCat(who, names[i], ": unknown dtype ", dtypes[i],
                                                     " or NULL data"));
    }
    refs[i]->dtype = *dtype;
    refs[i]->shape = std::span<const int64_t>(shapes[i], 3);
    refs[i]->data = std::string_view(static_cast<const char*>(data[i]), sizes[i]);
  }
  return absl::OkStatus();
}

}  // namespace

ATTN_C_EXPORT int attn_c_step(attn_c_client* client, const char* session_id, int32_t layer,
                              int32_t q_dtype, int64_t q0, int64_t q1, int64_t q2, const void* q,
                              size_t q_size, int32_t k_dtype, int64_t k0, int64_t k1, int64_t k2,
                              const void* k_new, size_t k_size, int32_t v_dtype, int64_t v0,
                              int64_t v1, int64_t v2, const void* v_new, size_t v_size,
                              float softmax_scale, int32_t return_lse, int32_t window_left,
                              int32_t window_right, int64_t timeout_ms, void* o, size_t o_size,
                              void* lse, size_t lse_size, int64_t* cached_tokens, void* timing,
                              size_t timing_capacity, size_t* timing_size, char* message,
                              size_t message_size) {
  attn::client::StepInputRef in;
  const int64_t shapes[3][3] = {{q0, q1, q2}, {k0, k1, k2}, {v0, v1, v2}};
  const int64_t* const shape_of[3] = {shapes[0], shapes[1], shapes[2]};
  const int32_t dtypes[3] = {q_dtype, k_dtype, v_dtype};
  const void* const data[3] = {q, k_new, v_new};
  const size_t sizes[3] = {q_size, k_size, v_size};
  if (absl::Status st = StepRefOf("attn_c_step: ", dtypes, shape_of, data, sizes, &in); !st.ok()) {
    return Failed(st, message, message_size);
  }
  if (client == nullptr || session_id == nullptr || o == nullptr ||
      (return_lse != 0) != (lse != nullptr)) {
    WriteMessage("attn_c_step: no client, session id or o, or lse and return_lse disagree",
                 message, message_size);
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  in.session_id = session_id;
  in.layer = layer;
  in.options.softmax_scale = softmax_scale;
  in.options.return_lse = return_lse != 0;
  in.options.window_left = window_left;
  in.options.window_right = window_right;
  grpc::ByteBuffer response;
  const grpc::Status st = CallBorrowing(
      client, Client::RawMethod::kStep, timeout_ms,
      [&](attn::client::BorrowedSlices* borrowed) {
        return attn::client::EncodeStepRequest(in, borrowed);
      },
      &response);
  if (!st.ok()) return Failed(st, message, message_size);
  const absl::Status read =
      ReadStepInto(&response, static_cast<attn::v1::DType>(q_dtype), o, o_size, lse, lse_size,
                   cached_tokens, timing, timing_capacity, timing_size);
  return read.ok() ? 0 : Failed(read, message, message_size);
}

// ---- Calls that do not block -------------------------------------------------------------------

struct attn_c_queue {
  struct Completion {
    uint64_t tag;
    int32_t code;
    attn_c_response* response;
  };

  int fd = -1;
  mutable std::mutex mu;
  std::condition_variable none_running;
  std::deque<Completion> done;                                  // guarded by mu
  // Calls started and not yet completed, with their context until gRPC is done with them.
  std::unordered_map<uint64_t, grpc::ClientContext*> running;  // guarded by mu
  // Starts of calls made on the queue's own thread (StartLater; StartOn says which).
  std::deque<std::function<void()>> starts;  // guarded by mu
  std::condition_variable start_ready;
  std::thread starter;    // made with the first such start; joined by attn_c_queue_destroy
  bool stopping = false;  // guarded by mu

  // Runs start on the queue's thread, while the caller (an event loop) goes on with its own work.
  void StartLater(std::function<void()> start) {
    std::lock_guard<std::mutex> lock(mu);
    if (!starter.joinable()) starter = std::thread([this] { RunStarts(); });
    starts.push_back(std::move(start));
    start_ready.notify_one();
  }

  void RunStarts() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      start_ready.wait(lock, [this] { return stopping || !starts.empty(); });
      if (starts.empty()) return;  // stopping, every call started
      std::function<void()> start = std::move(starts.front());
      starts.pop_front();
      lock.unlock();
      start();
      lock.lock();
    }
  }

  // Queues a finished call's completion (the call is no longer running) and signals the fd.
  // Under mu throughout: once running is empty, attn_c_queue_destroy may free this.
  void Complete(uint64_t tag, int32_t code, attn_c_response* response) {
    std::lock_guard<std::mutex> lock(mu);
    running.erase(tag);
    done.push_back({tag, code, response});
    const uint64_t one = 1;
    while (write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
    if (running.empty()) none_running.notify_all();
  }
};

namespace {

// One call started on a queue: what gRPC reads and writes until it finishes. Owned by gRPC's
// callback from the start, then by the release of the borrowed bytes; it frees itself once its
// completion is queued.
struct AsyncCall {
  attn_c_queue* queue = nullptr;
  uint64_t tag = 0;
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  attn::client::BorrowedSlices borrowed;
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  grpc::Status status;
  // Reads an answered call's response; returns the completion's code and leaves its response
  // (the answer's bytes for raw calls, nothing for a BatchStep read into its items).
  std::function<int32_t(AsyncCall*, attn_c_response*)> read;

  // gRPC's done: the context (which holds gRPC's call, and through it the bytes it was sending)
  // and the request go first, so that the borrowed bytes are let go of; the completion once they
  // are.
  void Done(grpc::Status st) {
    status = std::move(st);
    {
      std::lock_guard<std::mutex> lock(queue->mu);
      queue->running[tag] = nullptr;  // nothing left to cancel
    }
    ctx.reset();
    request.Clear();
    borrowed.NotifyWhenReleased([this] { Finish(); });
  }

  void Finish() {
    auto out = std::make_unique<attn_c_response>();
    int32_t code = 0;
    if (!status.ok()) {
      code = static_cast<int32_t>(status.error_code());
      out->buffer = MessageBuffer(status.error_message());
    } else {
      code = read(this, out.get());
    }
    out->size = out->buffer.Length();
    // What is freed after the completion touches neither the queue nor the caller's bytes.
    queue->Complete(tag, code, out.release());
    delete this;
  }

  static grpc::ByteBuffer MessageBuffer(std::string_view text) {
    grpc::Slice slice(text.data(), text.size());
    return grpc::ByteBuffer(&slice, 1);
  }
};

// A call is started on the queue's thread (attn_c_queue::StartLater) when its request is this
// large, or when more than kStartHereRunning calls of the queue run (its own included): a caller
// with many calls in flight is bound by its own thread, which gRPC's start of a call (tens of us
// on the calling thread, the write of the request's first bytes among them) would take from it.
// A lone small call starts on the caller's thread, with no hop to another.
constexpr size_t kStartElsewhereBytes = size_t{256} << 10;
constexpr size_t kStartHereRunning = 2;

// Registers call under its tag and starts it; INVALID_ARGUMENT when the tag is running already.
int StartOn(attn_c_client* client, attn_c_queue* queue, Client::RawMethod method,
            int64_t timeout_ms, std::unique_ptr<AsyncCall> call, char* message,
            size_t message_size) {
  client->client->PrepareContext(call->ctx.get(),
                                 std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)));
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(queue->mu);
    if (!queue->running.emplace(call->tag, call->ctx.get()).second) {
      WriteMessage(absl::StrCat("tag ", call->tag, " is in use by a running call"), message,
                   message_size);
      return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
    }
    busy = queue->running.size() > kStartHereRunning;
  }
  AsyncCall* c = call.release();  // gRPC's until Done (the queue's start until it is started)
  auto start = [client, method, c] {
    client->client->StartRawCall(method, c->ctx.get(), &c->request, &c->response,
                                 [c](grpc::Status st) { c->Done(std::move(st)); });
  };
  if (busy || c->request.Length() >= kStartElsewhereBytes) {
    queue->StartLater(std::move(start));  // a cancel before the start cancels it as it starts
  } else {
    start();
  }
  return 0;
}

int BadArgument(absl::string_view text, char* message, size_t message_size) {
  WriteMessage(text, message, message_size);
  return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
}

}  // namespace

ATTN_C_EXPORT attn_c_queue* attn_c_queue_create(char* error, size_t error_size) {
  auto queue = std::make_unique<attn_c_queue>();
  queue->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (queue->fd < 0) {
    WriteMessage(absl::StrCat("eventfd: ", std::strerror(errno)), error, error_size);
    return nullptr;
  }
  return queue.release();
}

ATTN_C_EXPORT int attn_c_queue_fd(const attn_c_queue* queue) {
  return queue == nullptr ? -1 : queue->fd;
}

ATTN_C_EXPORT size_t attn_c_queue_pending(const attn_c_queue* queue) {
  if (queue == nullptr) return 0;
  std::lock_guard<std::mutex> lock(queue->mu);
  return queue->running.size() + queue->done.size();
}

ATTN_C_EXPORT void attn_c_queue_cancel(attn_c_queue* queue, uint64_t tag) {
  if (queue == nullptr) return;
  std::lock_guard<std::mutex> lock(queue->mu);
  if (auto it = queue->running.find(tag); it != queue->running.end() && it->second != nullptr) {
    it->second->TryCancel();
  }
}

ATTN_C_EXPORT size_t attn_c_queue_poll(attn_c_queue* queue, uint64_t* tags, int32_t* codes,
                                       attn_c_response** responses, size_t max) {
  if (queue == nullptr || tags == nullptr || codes == nullptr || responses == nullptr) return 0;
  std::lock_guard<std::mutex> lock(queue->mu);
  size_t n = 0;
  for (; n < max && !queue->done.empty(); ++n) {
    const attn_c_queue::Completion& c = queue->done.front();
    tags[n] = c.tag;
    codes[n] = c.code;
    responses[n] = c.response;
    queue->done.pop_front();
  }
  return n;
}

ATTN_C_EXPORT void attn_c_queue_destroy(attn_c_queue* queue) {
  if (queue == nullptr) return;
  {
    std::unique_lock<std::mutex> lock(queue->mu);
    for (auto& [tag, ctx] : queue->running) {
      if (ctx != nullptr) ctx->TryCancel();
    }
    queue->none_running.wait(lock, [queue] { return queue->running.empty(); });
    for (const attn_c_queue::Completion& c : queue->done) delete c.response;
    queue->done.clear();
    queue->stopping = true;  // every start has run: its call has completed
  }
  queue->start_ready.notify_all();
  if (queue->starter.joinable()) queue->starter.join();
  close(queue->fd);
  delete queue;
}

ATTN_C_EXPORT int attn_c_call_start(attn_c_client* client, attn_c_queue* queue,
                                    const char* method, const void* const* parts,
                                    const size_t* sizes, size_t n, int64_t timeout_ms,
                                    uint64_t tag, char* message, size_t message_size) {
  Client::RawMethod raw{};
  if (client == nullptr || queue == nullptr || method == nullptr || !MethodOf(method, &raw)) {
    return BadArgument(absl::StrCat("attn_c_call_start: ", client == nullptr ? "no client" :
                                    queue == nullptr ? "no queue" :
                                    absl::StrCat("unknown method '", method ? method : "(null)",
                                                 "'")),
                       message, message_size);
  }
  if (!PartsValid("attn_c_call_start", parts, sizes, n, message, message_size)) {
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto call = std::make_unique<AsyncCall>();
  call->queue = queue;
  call->tag = tag;
  call->request = BorrowParts(&call->borrowed, parts, sizes, n);
  call->read = [](AsyncCall* c, attn_c_response* out) {
    out->buffer = std::move(c->response);
    return 0;
  };
  return StartOn(client, queue, raw, timeout_ms, std::move(call), message, message_size);
}

namespace {

// A completion's code and message for an answer that cannot be read.
int32_t FailedRead(const absl::Status& st, attn_c_response* out) {
  const absl::string_view text = st.message();
  out->buffer = AsyncCall::MessageBuffer(std::string_view(text.data(), text.size()));
  return static_cast<int32_t>(st.code());
}

// An answered BatchStep's results into its items; the call's code (0, or INTERNAL with the
// message in out when the answer cannot be read).
int32_t ReadBatchStepInto(grpc::ByteBuffer* response, attn_c_step_item* items, size_t n,
                          attn_c_response* out) {
  attn::client::ReceivedBytes received;
  std::vector<attn::client::DecodedStepResult> decoded;
  absl::Status st = received.Take(response);
  if (st.ok()) st = attn::client::DecodeBatchStepResponse(received.pieces, n, &decoded);
  if (!st.ok()) return FailedRead(st, out);
  for (size_t i = 0; i < n; ++i) {
    attn_c_step_item& item = items[i];
    const attn::v1::StepResult& status = decoded[i].status;
    absl::Status item_st =
        status.status_code() != 0
            ? absl::Status(static_cast<absl::StatusCode>(status.status_code()),
                           status.status_message())
            : WriteStepOutputs(decoded[i].response, static_cast<attn::v1::DType>(item.q_dtype),
                               item.o, item.o_size, item.lse, item.lse_size, &item.cached_tokens,
                               item.timing, item.timing_capacity, &item.timing_size);
    item.code = static_cast<int32_t>(item_st.code());
    if (!item_st.ok()) WriteMessage(item_st.message(), item.message, item.message_size);
  }
  return 0;
}

// item as the StepInputRef the wire coding takes; INVALID_ARGUMENT naming what is wrong (who
// prefixes the message).
absl::Status StepRefOfItem(const std::string& who, const attn_c_step_item& item,
                           attn::client::StepInputRef* ref) {
  const int32_t dtypes[3] = {item.q_dtype, item.k_dtype, item.v_dtype};
  const int64_t* const shapes[3] = {item.q_shape, item.k_shape, item.v_shape};
  const void* const data[3] = {item.q, item.k_new, item.v_new};
  const size_t sizes[3] = {item.q_size, item.k_size, item.v_size};
  if (absl::Status st = StepRefOf(who, dtypes, shapes, data, sizes, ref); !st.ok()) return st;
  if (item.session_id == nullptr || item.o == nullptr ||
      (item.return_lse != 0) != (item.lse != nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " no session id or o, or lse and return_lse disagree"));
  }
  ref->session_id = item.session_id;
  ref->layer = item.layer;
  ref->options.softmax_scale = item.softmax_scale;
  ref->options.return_lse = item.return_lse != 0;
  ref->options.window_left = item.window_left;
  ref->options.window_right = item.window_right;
  return absl::OkStatus();
}

}  // namespace

ATTN_C_EXPORT int attn_c_batch_step_start(attn_c_client* client, attn_c_queue* queue,
                                          attn_c_step_item* items, size_t n, int64_t timeout_ms,
                                          uint64_t tag, char* message, size_t message_size) {
  if (client == nullptr || queue == nullptr || (items == nullptr && n > 0)) {
    return BadArgument("attn_c_batch_step_start: no client, queue or items", message,
                       message_size);
  }
  std::vector<attn::client::StepInputRef> refs(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string who = absl::StrCat("attn_c_batch_step_start: items[", i, "].");
    if (absl::Status st = StepRefOfItem(who, items[i], &refs[i]); !st.ok()) {
      return Failed(st, message, message_size);
    }
  }
  auto call = std::make_unique<AsyncCall>();
  call->queue = queue;
  call->tag = tag;
  call->request = attn::client::EncodeBatchStepRequest(refs, &call->borrowed);
  call->read = [items, n](AsyncCall* c, attn_c_response* out) {
    return ReadBatchStepInto(&c->response, items, n, out);
  };
  return StartOn(client, queue, Client::RawMethod::kBatchStep, timeout_ms, std::move(call),
                 message, message_size);
}

ATTN_C_EXPORT int attn_c_step_start(attn_c_client* client, attn_c_queue* queue,
                                    attn_c_step_item* item, int64_t timeout_ms, uint64_t tag,
                                    char* message, size_t message_size) {
  if (client == nullptr || queue == nullptr || item == nullptr) {
    return BadArgument("attn_c_step_start: no client, queue or item", message, message_size);
  }
  attn::client::StepInputRef ref;
  if (absl::Status st = StepRefOfItem("attn_c_step_start: item.", *item, &ref); !st.ok()) {
    return Failed(st, message, message_size);
  }
  auto call = std::make_unique<AsyncCall>();
  call->queue = queue;
  call->tag = tag;
  call->request = attn::client::EncodeStepRequest(ref, &call->borrowed);
  call->read = [item](AsyncCall* c, attn_c_response* out) -> int32_t {
    const absl::Status st = ReadStepInto(
        &c->response, static_cast<attn::v1::DType>(item->q_dtype), item->o, item->o_size,
        item->lse, item->lse_size, &item->cached_tokens, item->timing, item->timing_capacity,
        &item->timing_size);
    if (!st.ok()) return FailedRead(st, out);
    item->code = 0;
    return 0;
  };
  return StartOn(client, queue, Client::RawMethod::kStep, timeout_ms, std::move(call), message,
                 message_size);
}

ATTN_C_EXPORT size_t attn_c_response_size(const attn_c_response* response) {
  return response == nullptr ? 0 : response->size;
}

ATTN_C_EXPORT void attn_c_response_take(attn_c_response* response, void* dst) {
  if (response == nullptr) return;
  std::vector<grpc::Slice> slices;
  if (response->buffer.Dump(&slices).ok()) {
    char* at = static_cast<char*>(dst);
    for (const grpc::Slice& s : slices) {
      std::memcpy(at, s.begin(), s.size());
      at += s.size();
    }
  }
  delete response;
}

ATTN_C_EXPORT void attn_c_response_free(attn_c_response* response) { delete response; }
