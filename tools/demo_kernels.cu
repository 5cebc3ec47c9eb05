// tools/demo_kernels.cu — the demo's device work on CUDA: slow on purpose
// (spins before writing), so that a missing wait would show as wrong bytes.
#include <cuda_runtime.h>

__global__ void k_slow_fill(unsigned char *p, size_t n, unsigned char v, long long cycles) {
  if (threadIdx.x == 0) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}

__global__ void k_slow_add(unsigned char *dst, const unsigned char *src, size_t n, unsigned char add, long long cycles) {
  if (threadIdx.x == 0) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = (unsigned char)(src[i] + add);
}

static long long cycles_for(double ms) {
  int dev = 0, khz = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  return (long long)(ms * khz);
}

extern "C" int demo_cuda_fill(void *stream, void *p, size_t n, unsigned char v, double ms) {
  k_slow_fill<<<1, 256, 0, (cudaStream_t)stream>>>((unsigned char *)p, n, v, cycles_for(ms));
  return (int)cudaGetLastError();
}

extern "C" int demo_cuda_add(void *stream, void *dst, const void *src, size_t n, unsigned char add, double ms) {
  k_slow_add<<<1, 256, 0, (cudaStream_t)stream>>>((unsigned char *)dst, (const unsigned char *)src, n, add, cycles_for(ms));
  return (int)cudaGetLastError();
}
