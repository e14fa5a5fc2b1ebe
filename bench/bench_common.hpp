// Pieces shared by the benchmarks:
//   whole_arg         a command-line number read whole, or a sentence naming the value and exit 2
//   alternating_rounds (CUDA builds) the timing of benchmarks that compare ways of doing one
//                     thing on the GPU: the ways alternate in `rounds` rounds (the first a warm-up,
//                     not kept), each timing `calls` calls back to back between CUDA events on
//                     `stream`; each way's `ms` gets one entry per kept round, per call. A way is
//                     anything with call() and a std::vector<float> ms.
#pragma once

#if FLASHDRAFT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace flashdraft::bench {

// argv[i] as a whole number in lo..hi (fallback when there is no argv[i]); otherwise
// "<program>: <what> must be a whole number in lo..hi, got "<value>"" and exit status 2.
inline int64_t whole_arg(int argc, char** argv, int i, int64_t fallback, int64_t lo, int64_t hi, const char* program,
                         const char* what) {
  if (argc <= i) return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || v < lo || v > hi) {
    std::fprintf(stderr, "%s: %s must be a whole number in %lld..%lld, got \"%s\"\n", program, what,
                 static_cast<long long>(lo), static_cast<long long>(hi), argv[i]);
    std::exit(2);
  }
  return v;
}

#if FLASHDRAFT_WITH_CUDA
template <class Way>
void alternating_rounds(std::vector<Way>& ways, int rounds, int calls, cudaStream_t stream) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int round = 0; round < rounds; ++round)
    for (Way& way : ways) {
      cudaEventRecord(start, stream);
      for (int i = 0; i < calls; ++i) way.call();
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (round > 0) way.ms.push_back(ms / calls);
    }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}
#endif

}  // namespace flashdraft::bench
