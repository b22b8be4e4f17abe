// What the handlers ask of the current device.
#pragma once

#include <cuda_runtime_api.h>

// Multiprocessors of the current device (0 if the runtime cannot say), read once per device:
// not a stream operation, so harmless during graph capture, and cached so steady-state calls
// make no driver queries.
inline int sm_count_of_current_device() {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    cached[dev] = n;
  }
  return cached[dev];
}
