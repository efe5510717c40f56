// Same-host shared memory (--allow_shared_memory): host regions registered through the region
// socket and the SharedMemory service, Attend reading q/k/v from them and writing o/lse into
// them, and the safety properties: another identity cannot see a region, unregistering or the
// client going away while requests run neither crashes attnd nor spoils those requests, limits
// hold, descriptors that could shrink are refused. The bad-input cases are in
// region_bad_input_test.cc. CPU backend, real attnd in-process on loopback.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "attn/client/region_client.h"
#include "region_test_util.h"
#include "test_util.h"

namespace attn {
namespace {

using client::HostRegion;
using client::RegionClient;
using testing::RegionRig;

TEST(SharedMemoryTest, AttendThroughRegionsEqualsInline) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  v1::AttendRequest request = rig.RegionRequest(/*o_in_region=*/true, /*lse=*/true);
  v1::AttendResponse response;
  ASSERT_TRUE(rig.Attend(request, &response).ok());
  // The response carries o's dtype, shape and slice, no bytes; the bytes are in the region.
  EXPECT_TRUE(response.o().data().empty());
  EXPECT_EQ(response.o().region().region(), "out");
  EXPECT_EQ(response.o().shape_size(), 3);
  EXPECT_TRUE(response.lse().data().empty());
  EXPECT_EQ(response.lse().region().region(), "out");

  v1::AttendResponse inline_response;
  ASSERT_TRUE(rig.Attend(rig.InlineRequest(/*lse=*/true), &inline_response).ok());
  const std::string& o = inline_response.o().data();
  const std::string& lse = inline_response.lse().data();
  ASSERT_EQ(o.size(), rig.o_bytes());
  EXPECT_EQ(std::memcmp(rig.out().data(), o.data(), o.size()), 0) << "o differs from inline";
  EXPECT_EQ(std::memcmp(rig.out().data() + rig.lse_offset(), lse.data(), lse.size()), 0)
      << "lse differs from inline";
  // And the inline answer is right.
  auto parsed = client::Client::ParseAttendResponse(inline_response);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_LT(testing::ErrorAgainstReference(rig.random(), parsed->o),
            testing::ToleranceFor(client::DType::kBFloat16));
}

TEST(SharedMemoryTest, MetricsCountRegionsAndTheirTensorBytes) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  const int port = rig.metrics_port();
  auto metric = [port](const std::string& name, const std::string& label) {
    return testing::ScrapeMetric(port, name, {label});
  };
  EXPECT_EQ(metric("attn_shared_memory_regions", "kind=\"host\""), 2);
  EXPECT_EQ(metric("attn_shared_memory_regions", "kind=\"cuda\""), 0);
  EXPECT_EQ(metric("attn_shared_memory_region_bytes", "kind=\"host\""),
            static_cast<double>(rig.in().size() + rig.out().size()));
  // Inputs from regions and outputs inline, then everything through regions.
  v1::AttendResponse response;
  ASSERT_TRUE(rig.Attend(rig.RegionRequest(/*o_in_region=*/false, /*lse=*/false), &response).ok());
  ASSERT_TRUE(rig.Attend(rig.RegionRequest(/*o_in_region=*/true, /*lse=*/true), &response).ok());
  // An inline request adds nothing.
  ASSERT_TRUE(rig.Attend(rig.InlineRequest(/*lse=*/true), &response).ok());
  const double inputs = static_cast<double>(rig.q_bytes() + 2 * rig.kv_bytes());
  EXPECT_EQ(metric("attn_shared_memory_tensor_bytes_total", "direction=\"read\""), 2 * inputs);
  EXPECT_EQ(metric("attn_shared_memory_tensor_bytes_total", "direction=\"written\""),
            static_cast<double>(rig.o_bytes() + rig.lse_bytes()));
  ASSERT_TRUE(rig.regions().Unregister("out").ok());
  EXPECT_EQ(metric("attn_shared_memory_regions", "kind=\"host\""), 1);
  EXPECT_EQ(metric("attn_shared_memory_region_bytes", "kind=\"host\""),
            static_cast<double>(rig.in().size()));
  rig.CloseRegionSocket();  // the client goes away: its regions are reclaimed
  for (int i = 0; i < 200 && metric("attn_shared_memory_regions", "kind=\"host\"") != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(metric("attn_shared_memory_regions", "kind=\"host\""), 0);
  EXPECT_EQ(metric("attn_shared_memory_region_bytes", "kind=\"host\""), 0);
}

TEST(SharedMemoryTest, InputsInRegionOutputInline) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  v1::AttendResponse response, inline_response;
  ASSERT_TRUE(rig.Attend(rig.RegionRequest(/*o_in_region=*/false, /*lse=*/false), &response).ok());
  ASSERT_TRUE(rig.Attend(rig.InlineRequest(false), &inline_response).ok());
  EXPECT_FALSE(response.o().has_region());
  EXPECT_EQ(response.o().data(), inline_response.o().data());
}

TEST(SharedMemoryTest, MixedInlineAndRegionTensors) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  v1::AttendRequest request = rig.RegionRequest(true, false);
  *request.mutable_q() = rig.InlineRequest(false).q();  // q inline, k and v in the region
  v1::AttendResponse response, inline_response;
  ASSERT_TRUE(rig.Attend(request, &response).ok());
  ASSERT_TRUE(rig.Attend(rig.InlineRequest(false), &inline_response).ok());
  EXPECT_EQ(std::memcmp(rig.out().data(), inline_response.o().data().data(), rig.o_bytes()), 0);
}

TEST(SharedMemoryTest, ListShowsRegionsAndLimitsUntilUnregistered) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  auto list = rig.regions().List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->regions_size(), 2);
  EXPECT_EQ(list->regions(0).name(), "in");
  EXPECT_EQ(list->regions(0).kind(), v1::REGION_KIND_HOST);
  EXPECT_EQ(list->regions(0).bytes(), rig.in().size());
  EXPECT_EQ(list->regions(0).in_flight(), 0);
  EXPECT_EQ(list->socket_path(), rig.socket_path());
  EXPECT_EQ(list->max_regions(), 4);
  ASSERT_TRUE(rig.regions().Unregister("in").ok());
  list = rig.regions().List();
  ASSERT_EQ(list->regions_size(), 1);
  EXPECT_EQ(list->regions(0).name(), "out");
  // A request naming the region now fails, naming the field.
  v1::AttendResponse response;
  const absl::Status st = rig.Attend(rig.RegionRequest(true, false), &response);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(st.message().find("q.region.region: no region named 'in'"), std::string::npos) << st;
}

// A region unregistered (and unmapped by its client) while a request uses it: the request
// completes correctly from attnd's own mapping, which goes only after it.
TEST(SharedMemoryTest, UnregisterWhileInFlightIsDeferred) {
  RegionRig rig({.seq = 2048, .threads = 1});  // a request that computes for a while
  ASSERT_TRUE(rig.Start());
  v1::AttendResponse inline_response;
  ASSERT_TRUE(rig.Attend(rig.InlineRequest(false), &inline_response).ok());
  std::memset(rig.out().data(), 0, rig.o_bytes());
  auto pending = std::async(std::launch::async, [&] {
    v1::AttendResponse r;
    return rig.Attend(rig.RegionRequest(true, false), &r);
  });
  // Wait until attnd holds the input region for the request.
  bool seen = false;
  for (int i = 0; i < 2000 && !seen; ++i) {
    auto list = rig.regions().List();
    ASSERT_TRUE(list.ok());
    for (const auto& r : list->regions()) seen = seen || (r.name() == "in" && r.in_flight() > 0);
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(seen) << "the request never held the region";
  ASSERT_TRUE(rig.regions().Unregister("in").ok());
  rig.DropInputRegion();  // the client unmaps and closes its memfd too
  const absl::Status st = pending.get();
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(std::memcmp(rig.out().data(), inline_response.o().data().data(), rig.o_bytes()), 0);
}

// The client's region socket closes (it exited): attnd drops its regions; requests then get
// NOT_FOUND.
TEST(SharedMemoryTest, RegionsOfAVanishedClientAreReclaimed) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  ASSERT_EQ(rig.RegionCount(), 2);
  rig.CloseRegionSocket();
  for (int i = 0; i < 200 && rig.RegionCount() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(rig.RegionCount(), 0);
  v1::AttendResponse response;
  EXPECT_EQ(rig.Attend(rig.RegionRequest(true, false), &response).code(),
            absl::StatusCode::kNotFound);
}

// Another identity (bearer token) sees none of the regions: requests, Unregister and List.
TEST(SharedMemoryTest, AnotherIdentityGetsNotFound) {
  RegionRig rig({.tokens = {"alpha", "beta"}});
  ASSERT_TRUE(rig.Start());
  auto other = rig.ClientWithToken("beta");
  ASSERT_NE(other, nullptr);
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  other->PrepareContext(&ctx, std::chrono::milliseconds(30000));
  const grpc::Status st =
      other->stub()->Attend(&ctx, rig.RegionRequest(true, false), &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_NE(st.error_message().find("q.region.region"), std::string::npos);
  auto other_regions = RegionClient::Connect(other.get());
  ASSERT_TRUE(other_regions.ok()) << other_regions.status();
  EXPECT_EQ((*other_regions)->Unregister("in").code(), absl::StatusCode::kNotFound);
  auto list = (*other_regions)->List();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->regions_size(), 0);
  // The owner still has both and can use them.
  EXPECT_EQ(rig.regions().List()->regions_size(), 2);
  EXPECT_TRUE(rig.Attend(rig.RegionRequest(true, false), &response).ok());
}

TEST(SharedMemoryTest, PerClientLimits) {
  RegionRig rig({.max_regions = 3, .max_bytes = int64_t{8} << 20});
  ASSERT_TRUE(rig.Start());  // "in" and "out" registered
  auto r3 = HostRegion::Create(4096);
  ASSERT_TRUE(rig.regions().Register("third", **r3).ok());
  auto r4 = HostRegion::Create(4096);
  auto st = rig.regions().Register("fourth", **r4);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.status().message().find("--shm_max_regions_per_client"), std::string::npos);
  ASSERT_TRUE(rig.regions().Unregister("third").ok());
  auto big = HostRegion::Create(size_t{8} << 20);
  st = rig.regions().Register("big", **big);
  EXPECT_EQ(st.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.status().message().find("--shm_max_bytes_per_client"), std::string::npos);
}

// Descriptors attnd must refuse: it could lose pages under its mapping (no F_SEAL_SHRINK), it
// is no memfd, or attnd could not write outputs into it.
TEST(SharedMemoryTest, UnsafeDescriptorsAreRefused) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  const int unsealed = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(unsealed, 4096), 0);
  auto h = rig.regions().SendDescriptor(unsealed);
  EXPECT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("F_SEAL_SHRINK"), std::string::npos) << h.status();
  close(unsealed);

  char path[] = "/tmp/attn-region-file-XXXXXX";
  const int file = mkstemp(path);
  ASSERT_GE(file, 0);
  ASSERT_EQ(ftruncate(file, 4096), 0);
  h = rig.regions().SendDescriptor(file);
  EXPECT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("not a memfd"), std::string::npos) << h.status();
  close(file);
  unlink(path);

  auto region = HostRegion::Create(4096);
  const int read_only = open(("/proc/self/fd/" + std::to_string((*region)->fd())).c_str(), O_RDONLY);
  ASSERT_GE(read_only, 0);
  h = rig.regions().SendDescriptor(read_only);
  EXPECT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("reading and writing"), std::string::npos) << h.status();
  close(read_only);

  const int empty = memfd_create("empty", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(fcntl(empty, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  h = rig.regions().SendDescriptor(empty);
  EXPECT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("empty"), std::string::npos) << h.status();
  close(empty);
  // The socket still serves after the refusals.
  auto ok = HostRegion::Create(4096);
  EXPECT_TRUE(rig.regions().SendDescriptor((*ok)->fd()).ok());
}

// In a child running as another user (nobody): connects to the region socket and reads its
// answer. Exit 0: refused as expected_refusal says ("file": connect fails with EACCES, "peer":
// attnd answers ERR naming its user rule); other codes: what went wrong.
int ConnectAsNobody(const std::string& path, const std::string& expected_refusal) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(10);
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      _exit(expected_refusal == "file" && errno == EACCES ? 0 : 11);
    }
    if (expected_refusal == "file") _exit(12);  // the file system let it through
    const timeval two_seconds{2, 0};  // a server that does not refuse sends nothing
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &two_seconds, sizeof(two_seconds));
    char answer[256] = {};
    const ssize_t n = recv(fd, answer, sizeof(answer) - 1, 0);
    const char want[] = "ERR the region socket serves only processes of attnd's own user";
    _exit(n > 0 && std::strncmp(answer, want, sizeof(want) - 1) == 0 ? 0 : 13);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Processes of another user cannot hand attnd memfds: the socket file is 0600, and with the file
// opened up attnd still refuses them by SO_PEERCRED.
TEST(SharedMemoryTest, OtherUsersAreRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another user";
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  struct stat st{};
  ASSERT_EQ(stat(rig.socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The rig's directory (mkdtemp, 0700) must let nobody reach the socket file at all.
  ASSERT_EQ(chmod(std::filesystem::path(rig.socket_path()).parent_path().c_str(), 0711), 0);
  EXPECT_EQ(ConnectAsNobody(rig.socket_path(), "file"), 0);
  ASSERT_EQ(chmod(rig.socket_path().c_str(), 0666), 0);
  EXPECT_EQ(ConnectAsNobody(rig.socket_path(), "peer"), 0);
  // The socket serves its own user on.
  auto region = HostRegion::Create(4096);
  EXPECT_TRUE(rig.regions().SendDescriptor((*region)->fd()).ok());
}

// Step and BatchStep do not read regions yet: a region field is refused by name (never read as an
// empty tensor), and the session's cache is unchanged.
TEST(SharedMemoryTest, HandleIsClaimedOnce) {
  RegionRig rig;
  ASSERT_TRUE(rig.Start());
  auto region = HostRegion::Create(4096);
  auto handle = rig.regions().SendDescriptor((*region)->fd());
  ASSERT_TRUE(handle.ok());
  v1::RegisterRegionRequest request;
  request.set_name("once");
  request.set_kind(v1::REGION_KIND_HOST);
  request.set_handle(*handle);
  EXPECT_TRUE(rig.Register(request).ok());
  request.set_name("twice");
  const absl::Status st = rig.Register(request);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("handle is unknown, expired"), std::string::npos) << st;
}

TEST(SharedMemoryTest, OffWithoutTheFlag) {
  auto s = testing::StartLoopbackServer();
  auto regions = RegionClient::Connect(s.client.get());
  ASSERT_FALSE(regions.ok());
  EXPECT_EQ(regions.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(regions.status().message().find("--allow_shared_memory"), std::string::npos);
  v1::AttendRequest request;
  std::mt19937_64 rng(1);
  auto r = testing::MakeRandomRequest({}, rng);
  request = client::Client::BuildAttendRequest(r.q, r.k, r.v, r.options);
  *request.mutable_k() = client::RegionTensor(client::DType::kBFloat16,
                                              {r.k.shape.begin(), r.k.shape.end()}, "in", 0);
  v1::AttendResponse response;
  grpc::ClientContext ctx;
  const grpc::Status st = s.client->stub()->Attend(&ctx, request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("k.region"), std::string::npos) << st.error_message();
}

}  // namespace
}  // namespace attn
