// Standalone timing + accuracy harness for the W rebuild of the prefill path (csrc/exl3/exl3_recon_full.cuh),
// W = diag(suh) · BD · Ŵ · BD · diag(svh), fp16 [k, n]: the fp32 kernel and the half2 kernel side by side (the
// launcher picks by K, RF_HALF_MAX_K in tuning.cuh; here both run at K = 4). No torch: builds in seconds
// (bench/recon_tune.sh).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc \
//        bench/recon_tune.cu -o recon_tune && ./recon_tune [k n]   (k n: that shape, MUL1 only)
//
// Per shape (4096x14336, 14336x4096, 4096x4096; K=4) and codebook (MUL1, 3INST): random trellis words
// (any bit stream is a valid trellis), random fp16 suh (+-[0.5, 2]) and svh (+-[0.005, 0.05]).
// Timing: CUDA graph of 16 launches over rotating weight copies (trellis > 3x L2, each copy its own
// output), CUDA events, median of 9 replays; us per launch, the memory floor (trellis + fp16 output
// bytes at 4.3 TB/s) and the fraction of it reached. Accuracy: the first 1024 rows of copy 0 against a
// double-precision reference from the decode kernel's Ŵ (launch_reconstruct_t, bit-exact fp16):
// max abs error, max abs error / RMS(W), relative L2 error.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "exl3/exl3_kernels.cuh"
#include "exl3/exl3_recon_full.cuh"
#include "tune_common.cuh"

constexpr int K = 4;
constexpr double HBM_BPS = 4.3e12;  // H200 HBM3e, achievable order of magnitude for the floor

template <int CB, bool HALF>
static void run_shape(int k, int n, const char* cbname) {
    const int kt = k / 16, nt = n / 16;
    const long words = (long)kt * nt * 8 * K;  // 16K int16 per 16x16 tile
    const long tbytes = words * 4, obytes = (long)k * n * 2;
    int l2 = 0;
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    const int copies = (int)std::max(2L, 3L * l2 / tbytes + 1);
    uint32_t* tr;
    __half *out, *su, *sv;
    CK(cudaMalloc(&tr, tbytes * copies));
    CK(cudaMalloc(&out, obytes * copies));
    CK(cudaMalloc(&su, k * 2));
    CK(cudaMalloc(&sv, n * 2));
    fill_random<<<1024, 256>>>(tr, words * copies, 1234u + k + n + CB);
    CK(cudaGetLastError());
    std::vector<__half> hsu(k), hsv(n);
    srand(7);
    auto uni = [] { return rand() / (double)RAND_MAX; };
    for (int i = 0; i < k; ++i) hsu[i] = __float2half((float)((rand() & 1 ? 1 : -1) * (0.5 + 1.5 * uni())));
    for (int i = 0; i < n; ++i) hsv[i] = __float2half((float)((rand() & 1 ? 1 : -1) * (0.005 + 0.045 * uni())));
    CK(cudaMemcpy(su, hsu.data(), k * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sv, hsv.data(), n * 2, cudaMemcpyHostToDevice));

    auto launch = [&](int i, cudaStream_t st) {
        const int c = i % copies;
        CK((exl3::launch_recon_full_t<K, CB, false, HALF>(tr + c * words, su, sv, out + c * (long)k * n, kt, nt, n, st)));
    };
    launch(0, 0);
    CK(cudaDeviceSynchronize());

    // accuracy on rows [0, kc) of copy 0: W = diag(suh) BD Ŵ BD diag(svh) / 128 in double
    const int kc = std::min(k, 1024);
    __half* wh;
    CK(cudaMalloc(&wh, obytes));
    exl3::launch_reconstruct_t<K, CB>(tr, wh, kt, nt, 0);
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    std::vector<__half> hw((long)kc * n), ho((long)kc * n);
    CK(cudaMemcpy(hw.data(), wh, (long)kc * n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ho.data(), out, (long)kc * n * 2, cudaMemcpyDeviceToHost));
    CK(cudaFree(wh));
    std::vector<double> ref((long)kc * n);
    for (long i = 0; i < (long)kc * n; ++i) ref[i] = __half2float(hw[i]);
    for (int r0 = 0; r0 < kc; r0 += 128)
        for (int c0 = 0; c0 < n; c0 += 128) {
            double* blk = &ref[(long)r0 * n + c0];
            for (int r = 0; r < 128; ++r) wht128(blk + (long)r * n, 1);  // along columns of each row
            for (int c = 0; c < 128; ++c) wht128(blk + c, n);           // along rows of each column
        }
    double num = 0, den = 0, maxe = 0;
    for (int r = 0; r < kc; ++r)
        for (int c = 0; c < n; ++c) {
            const long i = (long)r * n + c;
            const double w = ref[i] / 128.0 * __half2float(hsu[r]) * __half2float(hsv[c]);
            const double e = __half2float(ho[i]) - w;
            num += e * e;
            den += w * w;
            maxe = std::max(maxe, std::fabs(e));
        }
    const double rms = std::sqrt(den / ((double)kc * n));

    const float t = time_graph(launch, 16);
    const double floor_s = (double)(tbytes + obytes) / HBM_BPS;
    std::printf("%5dx%-5d %-5s %-5s %7.2f us | floor %6.2f us (%4.1f%% reached) | max|err| %.2e = %.2f x 2^-11 RMS(W), "
                "rel-L2 %.2e\n", k, n, cbname, HALF ? "half2" : "fp32", t * 1e6, floor_s * 1e6, 100 * floor_s / t, maxe, maxe / rms * 2048, std::sqrt(num / den));
    CK(cudaFree(tr));
    CK(cudaFree(out));
    CK(cudaFree(su));
    CK(cudaFree(sv));
}

// registers, local memory and resident CTAs of one kernel at K = 4, MUL1
template <bool HALF>
static void describe() {
    constexpr int smem = exl3::rf_smem_bytes<HALF>;
    auto kern = exl3::recon_full_pick<K, exl3::CB_MUL1, false, HALF>();
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes fa{};
    CK(cudaFuncGetAttributes(&fa, kern));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, exl3::RF_THREADS, smem));
    std::printf("%s kernel: K=4 MUL1 %d regs, %d B local, %d B dynamic smem, %d CTAs/SM%s\n", HALF ? "half2" : "fp32",
                fa.numRegs, (int)fa.localSizeBytes, smem, occ,
                HALF == exl3::rf_uses_half<K> ? " (the launcher's choice at K = 4)" : "");
}

int main(int argc, char** argv) {
    int dev = 0;
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, dev));
    std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
    describe<false>();
    describe<true>();
    if (argc == 3) {  // one shape, MUL1 only (for ncu)
        run_shape<exl3::CB_MUL1, false>(std::atoi(argv[1]), std::atoi(argv[2]), "MUL1");
        run_shape<exl3::CB_MUL1, true>(std::atoi(argv[1]), std::atoi(argv[2]), "MUL1");
        return 0;
    }
    const int shapes[3][2] = {{4096, 14336}, {14336, 4096}, {4096, 4096}};
    for (auto& s : shapes) {
        run_shape<exl3::CB_MUL1, false>(s[0], s[1], "MUL1");
        run_shape<exl3::CB_MUL1, true>(s[0], s[1], "MUL1");
        run_shape<exl3::CB_3INST, false>(s[0], s[1], "3INST");
        run_shape<exl3::CB_3INST, true>(s[0], s[1], "3INST");
    }
    return 0;
}
