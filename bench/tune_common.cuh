// Helpers shared by the standalone kernel harnesses (bench/gemv_tune.cu, bench/recon_tune.cu): no
// torch, so each builds with nvcc in seconds and a changed tuning value can be timed in one device call.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
            std::exit(1);                                                                      \
        }                                                                                      \
    } while (0)

// random 32-bit words (any bit stream is a valid trellis), a hash of the index and the seed
__global__ void fill_random(uint32_t* p, long n, uint32_t seed) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x << 13; x ^= x >> 17; x ^= x << 5; x *= 0x9E3779B1u; x ^= x >> 16;
        p[i] = x;
    }
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// seconds per launch of fn(i, stream), i = 0..calls-1, captured as one CUDA graph (no launch gaps);
// one eager round first (warm-up), then the median of `reps` timed replays
template <class F>
static float time_graph(F fn, int calls = 32, int reps = 9) {
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (int i = 0; i < calls; ++i) fn(i, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < calls; ++i) fn(i, st);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms * 1e-3f / calls);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaStreamDestroy(st));
    return median(t);
}

// unnormalized Walsh-Hadamard transform of 128 doubles in place: v[0], v[stride], ..., v[127 * stride]
static void wht128(double* v, long stride) {
    for (int h = 1; h < 128; h <<= 1)
        for (int i = 0; i < 128; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const double a = v[j * stride], b = v[(j + h) * stride];
                v[j * stride] = a + b;
                v[(j + h) * stride] = a - b;
            }
}
