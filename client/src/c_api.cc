// attn/client/c_api.h over attn::client::Client's raw calls.
#include "attn/client/c_api.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include <grpcpp/support/byte_buffer.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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
      WriteMessage(st.message(), error, error_size);
      return nullptr;
    }
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
  if (!client.ok()) {
    WriteMessage(client.status().message(), error, error_size);
    return nullptr;
  }
  return new attn_c_client{std::move(*client)};
}

ATTN_C_EXPORT void attn_c_client_destroy(attn_c_client* client) { delete client; }

ATTN_C_EXPORT int attn_c_call(attn_c_client* client, const char* method, const void* request,
                              size_t request_size, int64_t timeout_ms, attn_c_response** response,
                              char* message, size_t message_size) {
  if (response != nullptr) *response = nullptr;
  Client::RawMethod raw{};
  if (client == nullptr || response == nullptr || method == nullptr || !MethodOf(method, &raw)) {
    WriteMessage(absl::StrCat("attn_c_call: ", client == nullptr ? "no client" :
                              response == nullptr ? "no response pointer" :
                              absl::StrCat("unknown method '", method ? method : "(null)", "'")),
                 message, message_size);
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  if (request == nullptr && request_size > 0) {
    WriteMessage("attn_c_call: request is NULL", message, message_size);
    return static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT);
  }
  auto out = std::make_unique<attn_c_response>();
  grpc::Status st;
  {
    attn::client::BorrowedSlices borrowed;  // the caller's bytes go out in place
    grpc::Slice slice = borrowed.Borrow(request, request_size);
    grpc::ByteBuffer buffer(&slice, 1);
    slice = grpc::Slice();
    st = client->client->CallUnary(raw, std::move(buffer),
                                   std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0)),
                                   &out->buffer);
    // ~BorrowedSlices: returns once gRPC has let go of the request's bytes.
  }
  if (!st.ok()) {
    WriteMessage(st.error_message(), message, message_size);
    return static_cast<int>(st.error_code());
  }
  out->size = out->buffer.Length();
  *response = out.release();
  return 0;
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
