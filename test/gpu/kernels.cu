// test/gpu/kernels.cu — device work made slow on purpose, for race tests.
#include <cuda_runtime.h>

static long long cycles_for(double ms) {
  int dev = 0, khz = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  return (long long)(ms * (double)khz);
}

__device__ static void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void k_spin_write(int *p, int value, long long cycles) {
  spin(cycles);
  *p = value;
}

__global__ void k_spin_check(const unsigned char *p, int n, unsigned char expect, long long cycles, int *ok) {
  spin(cycles);
  int good = 1;
  for (int i = 0; i < n; i++) good &= p[i] == expect;
  *ok = good;
}

__global__ void k_fill(unsigned char *p, int n, unsigned char v) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = v;
}

__global__ void k_spin_fill(unsigned char *p, size_t n, unsigned char v, long long cycles) {
  spin(cycles);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

extern "C" int gpu_spin_fill(void *stream, void *p, size_t n, unsigned char v, double ms) {
  k_spin_fill<<<264, 256, 0, (cudaStream_t)stream>>>((unsigned char *)p, n, v, cycles_for(ms));
  return (int)cudaGetLastError();
}

extern "C" int gpu_spin_write(void *stream, int *p, int value, double ms) {
  k_spin_write<<<1, 1, 0, (cudaStream_t)stream>>>(p, value, cycles_for(ms));
  return (int)cudaGetLastError();
}

extern "C" int gpu_spin_check(void *stream, const void *p, int n, unsigned char expect, double ms, int *ok) {
  k_spin_check<<<1, 1, 0, (cudaStream_t)stream>>>((const unsigned char *)p, n, expect, cycles_for(ms), ok);
  return (int)cudaGetLastError();
}

extern "C" int gpu_fill(void *stream, void *p, int n, unsigned char v) {
  k_fill<<<1, 256, 0, (cudaStream_t)stream>>>((unsigned char *)p, n, v);
  return (int)cudaGetLastError();
}

// A stream the way a framework makes one (PyTorch's pool streams are
// non-blocking), for dp_stream_wrap.
extern "C" void *gpu_stream_create(void) {
  cudaStream_t s = NULL;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return NULL;
  return (void *)s;
}

extern "C" void gpu_stream_destroy(void *s) { cudaStreamDestroy((cudaStream_t)s); }
