// How long a dependent kernel waits after its predecessor's last block is done: griddepcontrol.wait (the
// grid-completion release every kernel boundary of the decode step pays) against a software flag (the
// predecessor's blocks bump a counter, the dependent's blocks poll it). A chain of N kernels, each launched as
// a programmatic dependent of the one before, captured in one CUDA graph and replayed.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icsrc bench/release_micro.cu -o /tmp/rm && /tmp/rm
//
// Per configuration (mode, trigger, blocks, work per block): the graph's time per kernel (time_graph: median
// of replays, CUDA events) and, from %globaltimer, the gap between kernel i-1's last block finishing and
// kernel i's first / last block being released (medians over the chain). Each kernel reads a value another block of its
// predecessor wrote and checks it, so a flag protocol that released too early would count errors.
#include "exl3/exl3_kernels.cuh"  // exl3::launch_as_dependent
#include "tune_common.cuh"

__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ int ld_relaxed(const int* p) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

struct Link {
    int idx, mode, early, blocks, sleep_ns;
    unsigned work_ns;
    int* done;      // [N] blocks of kernel i finished (both modes: the last one stamps t_done)
    int* errors;    // [1]
    unsigned long long* t_done;     // [N]
    unsigned long long* t_rel_min;  // [N]
    unsigned long long* t_rel_max;  // [N]
    int* buf;                       // [N][blocks]
};

__global__ void link_kernel(Link a) {
    if (a.early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (a.mode == 0 || a.idx == 0) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
    } else {
        if (threadIdx.x == 0) {
            const int* c = a.done + a.idx - 1;
            while (ld_relaxed(c) < a.blocks)
                if (a.sleep_ns > 0) __nanosleep(a.sleep_ns);
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
        }
        __syncthreads();
    }
    const unsigned long long t0 = gtime();
    if (threadIdx.x == 0) {
        atomicMin(a.t_rel_min + a.idx, t0);
        atomicMax(a.t_rel_max + a.idx, t0);
    }
    int v = a.idx;
    if (a.idx > 0) {  // another block's value of the previous kernel: idx - 1 + 1000 * that block
        const int src = (blockIdx.x * 7 + 3) % a.blocks;
        v = __ldcg(a.buf + (long)(a.idx - 1) * a.blocks + src);
        if (threadIdx.x == 0 && v != a.idx - 1 + 1000 * src) atomicAdd(a.errors, 1);
    }
    while (gtime() < t0 + a.work_ns) {
    }
    if (threadIdx.x == 0) a.buf[(long)a.idx * a.blocks + blockIdx.x] = a.idx + 1000 * (int)blockIdx.x;
    if (!a.early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        const int prev = atomicAdd(a.done + a.idx, 1);
        if (prev == a.blocks - 1) a.t_done[a.idx] = gtime();
    }
}

struct Result {
    float us_per_kernel, rel_first_us, rel_last_us;
    int errors;
};

static Result run(int mode, int early, int blocks, unsigned work_ns, int sleep_ns, int n, int threads) {
    int *done, *errors, *buf;
    unsigned long long *t_done, *t_min, *t_max;
    CK(cudaMalloc(&done, n * sizeof(int)));
    CK(cudaMalloc(&errors, sizeof(int)));
    CK(cudaMalloc(&buf, (size_t)n * blocks * sizeof(int)));
    CK(cudaMalloc(&t_done, n * 8));
    CK(cudaMalloc(&t_min, n * 8));
    CK(cudaMalloc(&t_max, n * 8));
    CK(cudaMemset(errors, 0, sizeof(int)));
    // link i of the chain; the first one clears the counters and stamps first (memset nodes in the graph)
    // and is a plain launch, the others programmatic dependents of the one before
    const float t = time_graph([&](int i, cudaStream_t st) {
        const Link a{i, mode, early, blocks, sleep_ns, work_ns, done, errors, t_done, t_min, t_max, buf};
        if (i > 0) {
            CK(exl3::launch_as_dependent(link_kernel, (unsigned)blocks, (unsigned)threads, st, a));
            return;
        }
        CK(cudaMemsetAsync(done, 0, n * sizeof(int), st));
        CK(cudaMemsetAsync(t_min, 0xFF, n * 8, st));
        CK(cudaMemsetAsync(t_max, 0, n * 8, st));
        link_kernel<<<blocks, threads, 0, st>>>(a);
    }, n, 21);
    std::vector<unsigned long long> hd(n), hmin(n), hmax(n);
    CK(cudaMemcpy(hd.data(), t_done, n * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hmin.data(), t_min, n * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hmax.data(), t_max, n * 8, cudaMemcpyDeviceToHost));
    std::vector<float> first, last;
    for (int i = 1; i < n; ++i) {
        first.push_back((float)(((double)hmin[i] - (double)hd[i - 1]) / 1000.0));
        last.push_back((float)(((double)hmax[i] - (double)hd[i - 1]) / 1000.0));
    }
    int herr = 0;
    CK(cudaMemcpy(&herr, errors, sizeof(int), cudaMemcpyDeviceToHost));
    const Result res{t * 1e6f, median(first), median(last), herr};
    CK(cudaFree(done));
    CK(cudaFree(errors));
    CK(cudaFree(buf));
    CK(cudaFree(t_done));
    CK(cudaFree(t_min));
    CK(cudaFree(t_max));
    return res;
}

int main() {
    const int n = 64;
    std::printf("mode  trigger  blocks  threads  work_ns  sleep | us/kernel  release first/last after the predecessor's "
                "last block (us)  errors\n");
    const int block_counts[] = {128, 256, 528};
    const unsigned works[] = {0, 2000, 4000};
    for (int threads : {128}) {
        for (int blocks : block_counts) {
            for (unsigned work : works) {
                for (int early : {1, 0}) {
                    for (int mode : {0, 1}) {
                        for (int sleep : (mode == 1 ? std::vector<int>{0, 100} : std::vector<int>{0})) {
                            const Result r = run(mode, early, blocks, work, sleep, n, threads);
                            std::printf("%-5s %-8s %6d  %7d  %7u  %5d | %9.3f  %6.3f / %6.3f  %d\n",
                                        mode == 0 ? "gdc" : "flag", early ? "start" : "end", blocks, threads, work,
                                        sleep, r.us_per_kernel, r.rel_first_us, r.rel_last_us, r.errors);
                        }
                    }
                }
            }
        }
    }
    return 0;
}
