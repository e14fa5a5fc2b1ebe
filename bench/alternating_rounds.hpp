// Timing shared by the benchmarks that compare ways of doing one thing on the GPU: the ways
// alternate in `rounds` rounds (the first a warm-up, not kept), each timing `calls` calls back to
// back between CUDA events on `stream`; each way's `ms` gets one entry per kept round, per call.
// A way is anything with call() and a std::vector<float> ms.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

namespace flashdraft::bench {

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

}  // namespace flashdraft::bench
