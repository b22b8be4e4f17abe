// What the handlers ask of the current device.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

// Multiprocessors of the current device (0 if the runtime cannot say), read once per device:
// not a stream operation, so harmless during graph capture, and cached so steady-state calls
// make no driver queries. Atomic because XLA runs each device's work on its own thread: two
// threads may fill the same entry (with the same value) the first time.
inline int sm_count_of_current_device() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}
