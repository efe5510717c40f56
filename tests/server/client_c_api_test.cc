// attn/client/c_api.h (libattn_client_c.so) against an attnd on loopback: its settings, its raw
// calls' answers against the C++ client's, and its errors (the call's status code and attnd's
// message; the library's own for bad arguments); calls through a completion queue: many in flight,
// its file descriptor, cancellation, deadlines, a queue destroyed under running calls, and
// BatchSteps coded by the library with each item's outcome.
#include "attn/client/c_api.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// The test links nothing but the library: a second copy of attnd's generated protobuf code in this
// process would clash with the library's own (one registry per process). Messages are written by
// hand, and attnd runs as a child process.

namespace attn {
namespace {

// attnd on 127.0.0.1, ports of its choosing, as a child process.
class Attnd {
 public:
  Attnd() {
    char path[] = "/tmp/attnd-c-api-XXXXXX";
    const int fd = mkstemp(path);
    log_ = path;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      execl(ATTND_PATH, ATTND_PATH, "--listen=127.0.0.1:0", "--metrics_listen=",
            "--backend=cpu", "--threads=2", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fd);
    const std::regex serving("serving attn\\.v1 on port (\\d+)");
    for (int i = 0; i < 600 && port_ == 0; ++i) {
      std::ifstream in(log_);
      std::stringstream text;
      text << in.rdbuf();
      const std::string s = text.str();
      std::smatch m;
      if (std::regex_search(s, m, serving)) port_ = std::stoi(m[1]);
      else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ~Attnd() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
    unlink(log_.c_str());
  }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string log_;
};

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// attn.v1.EchoRequest{payload = 1, response_bytes = 2}, as protobuf serializes it.
std::string EchoRequest(const std::string& payload, int64_t response_bytes = 0) {
  std::string out;
  if (!payload.empty()) {
    out.push_back('\x0a');
    PutVarint(payload.size(), &out);
    out += payload;
  }
  if (response_bytes != 0) {
    out.push_back('\x10');
    PutVarint(static_cast<uint64_t>(response_bytes), &out);
  }
  return out;
}

// The payload field of an EchoResponse (field 1); "<malformed>" when it is not one.
std::string EchoPayload(const std::string& response) {
  if (response.empty()) return "";
  if (response[0] != '\x0a') return "<malformed>";
  uint64_t n = 0;
  size_t at = 1;
  for (int shift = 0; at < response.size(); shift += 7) {
    const auto b = static_cast<uint8_t>(response[at++]);
    n |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) break;
  }
  if (at + n > response.size()) return "<malformed>";
  return response.substr(at, n);
}

using Settings = std::vector<std::pair<std::string, std::string>>;

struct Created {
  attn_c_client* client = nullptr;
  std::string error;
};

Created Create(const Settings& settings) {
  std::vector<const char*> keys, values;
  for (const auto& [k, v] : settings) {
    keys.push_back(k.c_str());
    values.push_back(v.c_str());
  }
  char error[512];
  error[0] = '\0';
  Created out;
  out.client = attn_c_client_create(keys.data(), values.data(), keys.size(), error, sizeof error);
  out.error = error;
  return out;
}

struct Answer {
  int code = -1;
  std::string message;
  std::string bytes;
};

Answer Call(attn_c_client* c, const char* method, const std::string& request,
            int64_t timeout_ms = 30000) {
  attn_c_response* response = nullptr;
  char message[512];
  message[0] = '\0';
  Answer a;
  a.code = attn_c_call(c, method, request.data(), request.size(), timeout_ms, &response, message,
                       sizeof message);
  a.message = message;
  if (a.code == 0) {
    EXPECT_NE(response, nullptr);
    a.bytes.resize(attn_c_response_size(response));
    attn_c_response_take(response, a.bytes.data());
  } else {
    EXPECT_EQ(response, nullptr);
  }
  return a;
}

std::string RandomBytes(size_t n, std::mt19937_64& rng) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

class ClientCApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(attn_c_abi_version(), ATTN_C_ABI_VERSION);
    ASSERT_GT(attnd_.port(), 0) << "attnd did not start";
    Created c = Create({{"target", attnd_.target()}, {"connections", "2"},
                        {"wait_for_ready", "1"}, {"arg:grpc.http2.lookahead_bytes", "65536"}});
    ASSERT_NE(c.client, nullptr) << c.error;
    client_ = c.client;
  }
  void TearDown() override { attn_c_client_destroy(client_); }

  static void SetUpTestSuite() { attnd_ptr_ = new Attnd(); }
  static void TearDownTestSuite() { delete attnd_ptr_; }

  static Attnd* attnd_ptr_;
  const Attnd& attnd_ = *attnd_ptr_;
  attn_c_client* client_ = nullptr;
};
Attnd* ClientCApiTest::attnd_ptr_ = nullptr;

TEST_F(ClientCApiTest, EchoReturnsTheSameBytes) {
  std::mt19937_64 rng(std::random_device{}());
  for (size_t n : {size_t(0), size_t(1), size_t(8192), size_t(3) << 20}) {
    const std::string payload = RandomBytes(n, rng);
    Answer a = Call(client_, "Echo", EchoRequest(payload));
    ASSERT_EQ(a.code, 0) << a.message;
    EXPECT_EQ(EchoPayload(a.bytes), payload) << n << " bytes";
  }
  // The same request in parts (tag and length, then the payload in three pieces).
  const std::string payload3 = RandomBytes(30000, rng);
  const std::string request = EchoRequest(payload3);
  const size_t head = request.size() - payload3.size();
  const void* parts[] = {request.data(), request.data() + head, request.data() + head + 7,
                         request.data() + head + 20000};
  const size_t sizes[] = {head, 7, 19993, 10000};
  attn_c_response* response = nullptr;
  char message[256];
  ASSERT_EQ(attn_c_call_parts(client_, "Echo", parts, sizes, 4, 30000, &response, message,
                              sizeof message), 0) << message;
  std::string got(attn_c_response_size(response), '\0');
  attn_c_response_take(response, got.data());
  EXPECT_EQ(EchoPayload(got), payload3);
  const void* null_part[] = {nullptr};
  const size_t one[] = {1};
  EXPECT_EQ(attn_c_call_parts(client_, "Echo", null_part, one, 1, 0, &response, message,
                              sizeof message), 3);
  // response_bytes: the first bytes only.
  const std::string payload = RandomBytes(1000, rng);
  Answer a = Call(client_, "Echo", EchoRequest(payload, 10));
  ASSERT_EQ(a.code, 0) << a.message;
  EXPECT_EQ(EchoPayload(a.bytes), payload.substr(0, 10));
}

TEST_F(ClientCApiTest, CallsFromManyThreadsGetTheirOwnAnswers) {
  std::vector<std::thread> threads;
  std::vector<int> wrong(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([this, t, &wrong] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 50; ++i) {
        const std::string payload = RandomBytes(1 + rng() % 20000, rng);
        Answer a = Call(client_, "Echo", EchoRequest(payload));
        if (a.code != 0 || EchoPayload(a.bytes) != payload) ++wrong[t];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(wrong[t], 0) << "thread " << t;
}

TEST_F(ClientCApiTest, ABadRequestGetsAttndsStatusAndMessage) {
  // An Attend with no tensors, a Step that names no session, and bytes that are no message.
  Answer attend = Call(client_, "Attend", "");
  EXPECT_EQ(attend.code, 3) << attend.message;  // INVALID_ARGUMENT
  EXPECT_NE(attend.message.find("q"), std::string::npos) << attend.message;
  Answer step = Call(client_, "Step", "");
  EXPECT_NE(step.code, 0);
  EXPECT_NE(step.message.find("session"), std::string::npos) << step.message;
  Answer junk = Call(client_, "BatchStep", std::string("\xff\xff\xff", 3));
  EXPECT_NE(junk.code, 0);
  EXPECT_FALSE(junk.message.empty());
  // The client still works afterwards.
  EXPECT_EQ(EchoPayload(Call(client_, "Echo", EchoRequest("after")).bytes), "after");
}

TEST_F(ClientCApiTest, ADeadlineThatPassesIsDeadlineExceeded) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string payload = RandomBytes(size_t(64) << 20, rng);
  Answer a = Call(client_, "Echo", EchoRequest(payload), /*timeout_ms=*/1);
  EXPECT_EQ(a.code, 4) << a.message;  // DEADLINE_EXCEEDED
}

TEST_F(ClientCApiTest, BadArgumentsAreRefusedWithAMessage) {
  attn_c_response* response = reinterpret_cast<attn_c_response*>(1);
  char message[64];
  EXPECT_EQ(attn_c_call(client_, "Fork", "", 0, 0, &response, message, sizeof message), 3);
  EXPECT_EQ(response, nullptr);
  EXPECT_NE(std::string(message).find("unknown method 'Fork'"), std::string::npos) << message;
  EXPECT_EQ(attn_c_call(nullptr, "Echo", "", 0, 0, &response, message, sizeof message), 3);
  EXPECT_EQ(attn_c_call(client_, "Echo", nullptr, 5, 0, &response, message, sizeof message), 3);
  // A message longer than the buffer is cut, and still NUL-terminated.
  char tiny[8];
  EXPECT_EQ(attn_c_call(client_, "NoSuchMethodWithALongName", "", 0, 0, &response, tiny,
                        sizeof tiny), 3);
  EXPECT_EQ(std::string(tiny).size(), sizeof tiny - 1);
}

// ---- Calls through a completion queue ---------------------------------------------------------

struct Completion {
  int code = -1;
  std::string bytes;  // the answer, or the status message
};

// Waits on the queue's fd (at most timeout_ms) and takes what completed, by tag.
std::map<uint64_t, Completion> WaitAndPoll(attn_c_queue* q, int timeout_ms = 30000) {
  std::map<uint64_t, Completion> out;
  pollfd p{attn_c_queue_fd(q), POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return out;
  uint64_t counter = 0;
  EXPECT_EQ(read(p.fd, &counter, sizeof counter), ssize_t(sizeof counter));
  uint64_t tags[16];
  int32_t codes[16];
  attn_c_response* responses[16];
  size_t n;
  while ((n = attn_c_queue_poll(q, tags, codes, responses, 16)) > 0) {
    for (size_t i = 0; i < n; ++i) {
      Completion& c = out[tags[i]];
      c.code = codes[i];
      c.bytes.resize(attn_c_response_size(responses[i]));
      attn_c_response_take(responses[i], c.bytes.data());
    }
  }
  return out;
}

// Collects the completions of `count` calls (or what came within the time).
std::map<uint64_t, Completion> Collect(attn_c_queue* q, size_t count) {
  std::map<uint64_t, Completion> all;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (all.size() < count && std::chrono::steady_clock::now() < until) {
    for (auto& [tag, c] : WaitAndPoll(q, 1000)) {
      EXPECT_TRUE(all.emplace(tag, std::move(c)).second) << "tag " << tag << " completed twice";
    }
  }
  return all;
}

// Echo calls tagged first, first + 1, ... answered OK, each with its own payload.
void ExpectEchoes(const std::map<uint64_t, Completion>& got, uint64_t first,
                  const std::vector<std::string>& payloads) {
  for (uint64_t i = 0; i < payloads.size(); ++i) {
    const Completion& c = got.at(first + i);
    ASSERT_EQ(c.code, 0) << c.bytes;
    EXPECT_EQ(EchoPayload(c.bytes), payloads[i]) << "call " << i;
  }
}

class ClientCApiQueueTest : public ClientCApiTest {
 protected:
  void SetUp() override {
    ClientCApiTest::SetUp();
    char error[128];
    queue_ = attn_c_queue_create(error, sizeof error);
    ASSERT_NE(queue_, nullptr) << error;
    ASSERT_GE(attn_c_queue_fd(queue_), 0);
  }
  void TearDown() override {
    attn_c_queue_destroy(queue_);  // before the client: its calls use the client's connections
    ClientCApiTest::TearDown();
  }

  int StartEcho(const std::string& request, uint64_t tag, int64_t timeout_ms = 30000) {
    const void* parts[] = {request.data()};
    const size_t sizes[] = {request.size()};
    char message[256];
    return attn_c_call_start(client_, queue_, "Echo", parts, sizes, 1, timeout_ms, tag, message,
                             sizeof message);
  }

  attn_c_queue* queue_ = nullptr;
};

TEST_F(ClientCApiQueueTest, ManyCallsInFlightEachGetTheirOwnAnswer) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<std::string> requests, payloads;
  for (int i = 0; i < 64; ++i) {
    payloads.push_back(RandomBytes(1 + rng() % 40000, rng));
    requests.push_back(EchoRequest(payloads.back()));
  }
  for (uint64_t i = 0; i < 64; ++i) ASSERT_EQ(StartEcho(requests[i], 1000 + i), 0);
  EXPECT_LE(attn_c_queue_pending(queue_), 64u);
  const auto got = Collect(queue_, 64);
  ASSERT_EQ(got.size(), 64u);
  ExpectEchoes(got, 1000, payloads);
  EXPECT_EQ(attn_c_queue_pending(queue_), 0u);
  // Nothing left. The fd may still be readable once (a completion queued between WaitAndPoll's
  // read of the fd and its poll was taken by that poll): then a poll finds none, and the fd is
  // quiet after that read.
  pollfd p{attn_c_queue_fd(queue_), POLLIN, 0};
  if (poll(&p, 1, 50) == 1) {
    uint64_t counter = 0, tag = 0;
    int32_t code = 0;
    attn_c_response* response = nullptr;
    EXPECT_EQ(read(p.fd, &counter, sizeof counter), ssize_t(sizeof counter));
    EXPECT_EQ(attn_c_queue_poll(queue_, &tag, &code, &response, 1), 0u);
  }
  EXPECT_EQ(poll(&p, 1, 50), 0);
}

// Calls start on the queue's thread when their request is 256 KiB or more or when more than two
// of the queue's calls run (the first two small ones here start on the caller's): mixed in
// flight, each call still gets its own answer; one cancelled right after its start (most likely
// before the queue's thread started it) completes CANCELLED, unless it finished first.
TEST_F(ClientCApiQueueTest, LargeRequestsStartedOnTheQueuesThreadGetTheirOwnAnswers) {
  std::mt19937_64 rng(std::random_device{}());
  std::vector<std::string> requests, payloads;
  for (int i = 0; i < 24; ++i) {
    const size_t bytes = i % 2 == 0 ? (size_t{256} << 10) + rng() % (size_t{1} << 20)
                                    : 1 + rng() % 100000;
    payloads.push_back(RandomBytes(bytes, rng));
    requests.push_back(EchoRequest(payloads.back()));
  }
  for (uint64_t i = 0; i < 24; ++i) ASSERT_EQ(StartEcho(requests[i], 500 + i), 0);
  const std::string cancelled = EchoRequest(RandomBytes(size_t{8} << 20, rng));
  ASSERT_EQ(StartEcho(cancelled, 99), 0);
  attn_c_queue_cancel(queue_, 99);
  const auto got = Collect(queue_, 25);
  ASSERT_EQ(got.size(), 25u);
  ExpectEchoes(got, 500, payloads);
  const Completion& c = got.at(99);
  EXPECT_TRUE(c.code == 1 || (c.code == 0 && EchoPayload(c.bytes).size() == (size_t{8} << 20)))
      << c.code << ": " << c.bytes.substr(0, 200);
  EXPECT_EQ(attn_c_queue_pending(queue_), 0u);
}

TEST_F(ClientCApiQueueTest, CancelDeadlineAndTagInUse) {
  std::mt19937_64 rng(std::random_device{}());
  const std::string big = EchoRequest(RandomBytes(size_t(64) << 20, rng));
  ASSERT_EQ(StartEcho(big, 1), 0);
  char message[128];
  const void* parts[] = {big.data()};
  const size_t sizes[] = {big.size()};
  EXPECT_EQ(attn_c_call_start(client_, queue_, "Echo", parts, sizes, 1, 0, 1, message,
                              sizeof message), 3);
  EXPECT_NE(std::string(message).find("tag 1 is in use"), std::string::npos) << message;
  attn_c_queue_cancel(queue_, 1);
  attn_c_queue_cancel(queue_, 999);  // no such call: nothing happens
  ASSERT_EQ(StartEcho(big, 2, /*timeout_ms=*/1), 0);
  const auto got = Collect(queue_, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got.at(1).code, 1) << got.at(1).bytes;  // CANCELLED
  EXPECT_EQ(got.at(2).code, 4) << got.at(2).bytes;  // DEADLINE_EXCEEDED
  EXPECT_FALSE(got.at(2).bytes.empty());
  // The tag is free again, and the queue still works. (The request must outlive its call.)
  const std::string again_request = EchoRequest("again");
  ASSERT_EQ(StartEcho(again_request, 1), 0);
  const auto again = Collect(queue_, 1);
  ASSERT_EQ(again.count(1), 1u);
  EXPECT_EQ(EchoPayload(again.at(1).bytes), "again");
}

TEST_F(ClientCApiQueueTest, AQueueDestroyedUnderRunningCallsCancelsAndWaitsForThem) {
  std::mt19937_64 rng(std::random_device{}());
  char error[64];
  attn_c_queue* q = attn_c_queue_create(error, sizeof error);
  ASSERT_NE(q, nullptr);
  auto request = std::make_unique<std::string>(EchoRequest(RandomBytes(size_t(32) << 20, rng)));
  const void* parts[] = {request->data()};
  const size_t sizes[] = {request->size()};
  for (uint64_t t = 0; t < 4; ++t) {
    ASSERT_EQ(attn_c_call_start(client_, q, "Echo", parts, sizes, 1, 0, t, error, sizeof error),
              0);
  }
  attn_c_queue_destroy(q);
  // gRPC has let go of the request: freeing it now is safe (ASan would say otherwise).
  request.reset();
  EXPECT_EQ(EchoPayload(Call(client_, "Echo", EchoRequest("still")).bytes), "still");
}

// A BatchStep item of a decode step: q [1, 4, 8] and k_new, v_new [1, 2, 8], bfloat16 (DType 3).
struct StepBuffers {
  std::vector<uint16_t> q = std::vector<uint16_t>(32, 0x3f80);
  std::vector<uint16_t> k = std::vector<uint16_t>(16, 0x3f80);
  std::vector<uint16_t> v = std::vector<uint16_t>(16, 0x3f80);
  std::vector<uint16_t> o = std::vector<uint16_t>(32, 0xffff);
  char message[256] = {};

  attn_c_step_item Item(const char* session) {
    attn_c_step_item it{};
    it.session_id = session;
    it.q_dtype = it.k_dtype = it.v_dtype = 3;
    const int64_t qs[3] = {1, 4, 8}, ks[3] = {1, 2, 8};
    std::copy(qs, qs + 3, it.q_shape);
    std::copy(ks, ks + 3, it.k_shape);
    std::copy(ks, ks + 3, it.v_shape);
    it.q = q.data();
    it.k_new = k.data();
    it.v_new = v.data();
    it.q_size = 2 * q.size();
    it.k_size = 2 * k.size();
    it.v_size = 2 * v.size();
    it.window_left = it.window_right = -1;
    it.o = o.data();
    it.o_size = 2 * o.size();
    it.message = message;
    it.message_size = sizeof message;
    it.code = -1;
    return it;
  }
};

TEST_F(ClientCApiQueueTest, BatchStepItemsGetTheirOwnOutcome) {
  // Sessions this attnd never made: the call is answered, each item with NOT_FOUND naming its id.
  StepBuffers a, b;
  attn_c_step_item items[2] = {a.Item("no-such-session-a"), b.Item("no-such-session-b")};
  char message[256];
  ASSERT_EQ(attn_c_batch_step_start(client_, queue_, items, 2, 30000, 7, message, sizeof message),
            0) << message;
  const auto got = Collect(queue_, 1);
  ASSERT_EQ(got.count(7), 1u);
  EXPECT_EQ(got.at(7).code, 0) << got.at(7).bytes;
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(items[i].code, 5) << items[i].message;  // NOT_FOUND
    const char* id = i == 0 ? "no-such-session-a" : "no-such-session-b";
    EXPECT_NE(std::string(items[i].message).find(id), std::string::npos) << items[i].message;
  }
  // Refused before anything is sent: an unknown dtype (naming the item and tensor), a NULL o, lse
  // asked for without a buffer; nothing is queued.
  attn_c_step_item bad[2] = {a.Item("x"), b.Item("y")};
  bad[1].k_dtype = 77;
  EXPECT_EQ(attn_c_batch_step_start(client_, queue_, bad, 2, 0, 8, message, sizeof message), 3);
  EXPECT_NE(std::string(message).find("items[1].k_new: unknown dtype 77"), std::string::npos)
      << message;
  bad[1] = b.Item("y");
  bad[0].o = nullptr;
  EXPECT_EQ(attn_c_batch_step_start(client_, queue_, bad, 2, 0, 8, message, sizeof message), 3);
  bad[0] = a.Item("x");
  bad[0].return_lse = 1;
  EXPECT_EQ(attn_c_batch_step_start(client_, queue_, bad, 2, 0, 8, message, sizeof message), 3);
  EXPECT_NE(std::string(message).find("items[0]"), std::string::npos) << message;
  EXPECT_EQ(attn_c_batch_step_start(nullptr, queue_, bad, 2, 0, 8, message, sizeof message), 3);
  EXPECT_EQ(attn_c_queue_pending(queue_), 0u);
}

TEST_F(ClientCApiQueueTest, AStartedStepFailsWithItsStatusOrIsRefusedBeforeSending) {
  // A session this attnd never made: the Step call itself fails NOT_FOUND, naming the session in
  // the completion's message, and the item's outcome is left as it was.
  StepBuffers a;
  attn_c_step_item item = a.Item("no-such-session-c");
  char message[256];
  ASSERT_EQ(attn_c_step_start(client_, queue_, &item, 30000, 9, message, sizeof message), 0)
      << message;
  const auto got = Collect(queue_, 1);
  ASSERT_EQ(got.count(9), 1u);
  EXPECT_EQ(got.at(9).code, 5) << got.at(9).bytes;  // NOT_FOUND
  EXPECT_NE(got.at(9).bytes.find("no-such-session-c"), std::string::npos) << got.at(9).bytes;
  EXPECT_EQ(item.code, -1);
  EXPECT_EQ(a.o[0], 0xffff);  // o untouched
  // Refused before anything is sent: nothing is queued.
  attn_c_step_item bad = a.Item("x");
  bad.v_dtype = 0;
  EXPECT_EQ(attn_c_step_start(client_, queue_, &bad, 0, 10, message, sizeof message), 3);
  EXPECT_NE(std::string(message).find("item.v_new: unknown dtype 0"), std::string::npos)
      << message;
  bad = a.Item("x");
  bad.o = nullptr;
  EXPECT_EQ(attn_c_step_start(client_, queue_, &bad, 0, 10, message, sizeof message), 3);
  EXPECT_EQ(attn_c_step_start(client_, queue_, nullptr, 0, 10, message, sizeof message), 3);
  EXPECT_EQ(attn_c_step_start(client_, nullptr, &bad, 0, 10, message, sizeof message), 3);
  EXPECT_EQ(attn_c_queue_pending(queue_), 0u);
}

TEST(ClientCApiSettings, BadSettingsAreRefusedNamingThem) {
  struct Case {
    Settings settings;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{}, "target is empty"},
      {{{"target", "127.0.0.1:1"}, {"colour", "blue"}}, "unknown setting 'colour'"},
      {{{"target", "127.0.0.1:1"}, {"connections", "many"}}, "connections: expected an integer"},
      {{{"target", "127.0.0.1:1"}, {"connections", "0"}}, "connections: 0 is outside"},
      {{{"target", "127.0.0.1:1"}, {"tls", "maybe"}}, "tls: expected 0 or 1"},
      {{{"target", "127.0.0.1:1"}, {"retry_max_attempts", "9"}}, "retry_max_attempts"},
      {{{"target", "127.0.0.1:1"}, {"arg:grpc.x", "1e3"}}, "arg:grpc.x: expected an integer"},
      {{{"target", "127.0.0.1:1"}, {"lb_policy", "Round Robin"}}, "lb_policy"},
      {{{"target", "127.0.0.1:1"}, {"tls_cert_pem", "x"}}, "given together"},
  };
  for (const Case& c : cases) {
    Created got = Create(c.settings);
    EXPECT_EQ(got.client, nullptr) << c.says;
    EXPECT_NE(got.error.find(c.says), std::string::npos) << got.error << " / " << c.says;
    attn_c_client_destroy(got.client);  // NULL is fine
  }
  const char* keys[] = {"target", nullptr};
  const char* values[] = {"127.0.0.1:1", "x"};
  char error[128];
  EXPECT_EQ(attn_c_client_create(keys, values, 2, error, sizeof error), nullptr);
  EXPECT_NE(std::string(error).find("NULL"), std::string::npos) << error;
}

TEST(ClientCApiSettings, AServerThatIsDownIsUnavailable) {
  // A port nothing listens on.
  Created c = Create({{"target", "127.0.0.1:1"}});
  ASSERT_NE(c.client, nullptr) << c.error;
  Answer a = Call(c.client, "Echo", EchoRequest("x"), 5000);
  EXPECT_EQ(a.code, 14) << a.message;  // UNAVAILABLE
  attn_c_client_destroy(c.client);
}

}  // namespace
}  // namespace attn
