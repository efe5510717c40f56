// attn-cuda-launch-cost-bench: what each CUDA API call of a step launch costs the host thread that
// enqueues it, and what the whole enqueue of a lone decode step costs with and without its timing
// events. A lone step's launch is latency-bound: its enqueue is on the caller's path, so each call
// it makes counts.
//   attn-cuda-launch-cost-bench [--reps 20000]
// Prints, per call kind, the median and p90 host microseconds of one call (each measured on an
// idle stream after the previous work finished), then the same for whole launch sequences.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

__global__ void TouchKernel(int* p, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                  \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

struct Sample {
  double median, p90;
};

Sample Summarise(std::vector<double>& us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[us.size() * 9 / 10]};
}

// Times fn (host microseconds) reps times, synchronising the stream after each.
Sample Time(int reps, cudaStream_t stream, const std::function<void()>& fn) {
  std::vector<double> us;
  us.reserve(reps);
  for (int r = 0; r < reps + reps / 10; ++r) {
    const auto t0 = Clock::now();
    fn();
    const auto t1 = Clock::now();
    CHECK(cudaStreamSynchronize(stream));
    if (r >= reps / 10) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return Summarise(us);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0) reps = std::max(100, std::atoi(argv[++i]));
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t timed[4], untimed;
  for (auto& e : timed) CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
  CHECK(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming));
  // A lone decode step's bytes: q 8 KiB, k/v 2 KiB each, tables ~2 KiB in; o 8 KiB out.
  constexpr size_t kIn = 16 << 10, kOut = 8 << 10;
  char *host_in, *host_out, *dev_in, *dev_out;
  CHECK(cudaMallocHost(&host_in, kIn));
  CHECK(cudaMallocHost(&host_out, kOut));
  CHECK(cudaMalloc(&dev_in, kIn));
  CHECK(cudaMalloc(&dev_out, kOut));
  std::memset(host_in, 1, kIn);
  int* dev_ints = reinterpret_cast<int*>(dev_in);

  auto launch = [&] { TouchKernel<<<1, 128, 0, stream>>>(dev_ints, 128); };
  auto launch_pdl = [&] {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(1);
    config.blockDim = dim3(128);
    config.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attr;
    config.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&config, TouchKernel, dev_ints, 128));
  };
  auto h2d = [&] { CHECK(cudaMemcpyAsync(dev_in, host_in, kIn, cudaMemcpyHostToDevice, stream)); };
  auto d2h = [&] { CHECK(cudaMemcpyAsync(host_out, dev_out, kOut, cudaMemcpyDeviceToHost, stream)); };

  std::printf("attn-cuda-launch-cost-bench: %s, %d reps; host us per call (median, p90)\n\n",
              prop.name, reps);
  std::printf("| call | median us | p90 us |\n| --- | ---: | ---: |\n");
  auto row = [&](const char* name, const std::function<void()>& fn) {
    const Sample s = Time(reps, stream, fn);
    std::printf("| %s | %.2f | %.2f |\n", name, s.median, s.p90);
  };
  row("cudaEventRecord (timing)", [&] { CHECK(cudaEventRecord(timed[0], stream)); });
  row("cudaEventRecord (no timing)", [&] { CHECK(cudaEventRecord(untimed, stream)); });
  row("kernel <<<>>> (1 CTA)", launch);
  row("cudaLaunchKernelEx (PDL attribute)", launch_pdl);
  row("cudaMemcpyAsync H2D 16 KiB pinned", h2d);
  row("cudaMemcpyAsync D2H 8 KiB pinned", d2h);
  row("cudaMemsetAsync 8 B", [&] { CHECK(cudaMemsetAsync(dev_out, 0, 8, stream)); });
  row("cudaEventQuery (done)", [&] { (void)cudaEventQuery(timed[0]); });
  row("cudaGetDevice", [&] {
    int d;
    CHECK(cudaGetDevice(&d));
  });

  // Whole sequences as a lone step enqueues them: H2D, append kernel, decode split + combine,
  // D2H, with four timing events (today's) or one completion event without timing.
  std::printf("\n| lone-step enqueue sequence | median us | p90 us |\n| --- | ---: | ---: |\n");
  auto sequence = [&](bool four_timed) {
    if (four_timed) CHECK(cudaEventRecord(timed[0], stream));
    h2d();
    launch();  // append
    if (four_timed) CHECK(cudaEventRecord(timed[1], stream));
    launch();      // decode split
    launch_pdl();  // combine
    if (four_timed) CHECK(cudaEventRecord(timed[2], stream));
    d2h();
    CHECK(cudaEventRecord(four_timed ? timed[3] : untimed, stream));
  };
  row("4 timing events + 5 work calls", [&] { sequence(true); });
  row("1 completion event (no timing) + 5 work calls", [&] { sequence(false); });
  // And the host's wait for such a launch: enqueue, then poll its last event to completion.
  std::printf("\n| lone-step enqueue + poll to completion | median us | p90 us |\n| --- | ---: | ---: |\n");
  auto poll = [&](cudaEvent_t e) {
    while (cudaEventQuery(e) == cudaErrorNotReady) {
    }
  };
  row("4 timing events", [&] {
    sequence(true);
    poll(timed[3]);
  });
  row("1 completion event", [&] {
    sequence(false);
    poll(untimed);
  });
  return 0;
}
