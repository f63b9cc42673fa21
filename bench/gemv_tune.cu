// Standalone tuning harness for the one-launch EXL3 linear at decode sizes (no torch): builds in
// seconds with nvcc (bench/gemv_tune.sh), so a changed value of csrc/exl3/tuning.cuh can be timed in one
// device call. It times the product's kernels and launchers as built from those values; the k chunk,
// pre-decoding mode and shapes are chosen at run time (arguments and TUNE_* variables below).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --use_fast_math --expt-relaxed-constexpr -Icsrc -Ibench/ext \
//        [-DTUNE_K=K -DTUNE_CB=CB] bench/gemv_tune.cu -o gemv_tune && ./gemv_tune [kt ...]
//
// Per shape (4096x14336, 14336x4096 and 4096x28672 = the 8B gate/up pair; K=4, codebook TUNE_CB):
// the fused op at m=1 for each k chunk size given (0 = the launcher's choice), the decode-only kernel
// on the SAME shape (the integer-pipeline ceiling for these weights, launch and tail included), the
// inner split-k GEMM, and the fused op and the decode-only kernel as programmatic dependents
// (back-to-back launches overlapping, as the engine launches the linear with EXL3_PDL).
// Timing: CUDA graph of 32 launches over rotating trellis copies (> 3x L2), CUDA events,
// median of 9 replays. Correctness: the fused output against an fp64 host reference built from
// the reconstruct kernel's Ŵ (relative L2 error printed; must be < 1e-3).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "decode_only.cuh"
#include "exl3/exl3_fused.cuh"
#include "exl3/exl3_kernels.cuh"
#include "tune_common.cuh"

#ifndef TUNE_CB
#define TUNE_CB 2
#endif
#ifndef TUNE_K
#define TUNE_K 4
#endif

static void had128_host(double* v) {  // in place, normalized, as the kernels' butterfly (value-wise)
    wht128(v, 1);
    for (int i = 0; i < 128; ++i) v[i] *= 0.088388347648318440550;
}

static float h2f(__half h) { return __half2float(h); }

// TUNE_CHAIN="KxN,KxN,...": one decoder layer's linears launched in that order (e.g. q/k/v, o, gate/up,
// down of the 8B shape), repeated over 4 layers' worth of distinct trellis (more than L2 holds),
// each launch a programmatic dependent of the one before, as in the engine's decode step: time per
// layer with and without PDL. The data does not flow from one linear to the next (timing only).
// Letters after a shape switch on the engine's extras for that linear: n = deferred RMSNorm in the
// prologue, g = gated activation input, r = residual add + row sums in the epilogue, q = q/k/v as
// three problems (n/6 columns each for k and v), RoPE (head 128) on q and k, k and v rows to a cache.
// The 8B decode layer: TUNE_CHAIN=4096x6144nq,4096x4096r,4096x28672n,14336x4096gr. "@N" after the
// letters forces N k tiles per chunk; an entry "c" is a small combine-like kernel (32 blocks of 128
// threads: wait, signal, read 16 KB, write 8 KB), the attention combine before o_proj. TUNE_M=1..8: rows
// per launch (a batched decode step; default 1). TUNE_XH=N: from N rows, x is transformed once per launch
// (fused_xh_kernel) instead of in every block's prologue. TUNE_PREDECODE=0|1|2: the launcher's pre-decoding
// mode (FusedArgs::predecode: off, on, on with the early signal; default 2), for A/B runs in one build;
// TUNE_PD_MAX_KT=N: its longest chunk (FusedArgs::predecode_max_kt; 0: the ring's length).
// The launcher's options of every fused launch here (the product's ops take them per call: their `launch`
// argument), read once from TUNE_PREDECODE / TUNE_PD_MAX_KT.
struct PredecodeOpts {
    int mode = 2, max_kt = 0;
};
static PredecodeOpts predecode_opts() {
    static const PredecodeOpts o = [] {
        PredecodeOpts r;
        if (const char* pd = std::getenv("TUNE_PREDECODE")) r.mode = std::max(0, std::min(2, std::atoi(pd)));
        if (const char* pk = std::getenv("TUNE_PD_MAX_KT")) r.max_kt = std::max(0, std::atoi(pk));
        return r;
    }();
    return o;
}
// zero-initialised FusedArgs with the run's pre-decoding options
static exl3::FusedArgs fused_args() {
    exl3::FusedArgs a{};
    a.predecode = predecode_opts().mode;
    a.predecode_max_kt = predecode_opts().max_kt;
    return a;
}

struct CombineLike {
    const float* in;
    __half* out;
};

__global__ void combine_like(CombineLike c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    c.out[i] = __float2half(c.in[i] + c.in[i + 4096]);
}

template <int K, int CB>
static int layer_chain(const char* spec) {
    std::vector<std::pair<int, int>> sh;
    std::vector<std::string> extras;
    std::vector<int> kts;
    for (const char* s = spec; *s;) {
        int k = 0, n = 0, used = 0;
        if (*s == 'c') {  // the combine-like kernel: no weights
            sh.push_back({0, 0});
            extras.push_back("c");
            kts.push_back(0);
            ++s;
            if (*s == ',') ++s;
            continue;
        }
        if (std::sscanf(s, "%dx%d%n", &k, &n, &used) != 2 || k % 128 || n % 128) return 2;
        sh.push_back({k, n});
        s += used;
        std::string ex;
        while (*s && *s != ',' && *s != '@') ex += *s++;
        int kt = 0;
        if (*s == '@') kt = (int)std::strtol(s + 1, const_cast<char**>(&s), 10);
        if (ex.find('q') != std::string::npos && (n % 6 || (n / 6) % 128)) return 2;
        extras.push_back(ex);
        kts.push_back(kt);
        if (*s == ',') ++s;
    }
    constexpr int LAYERS = 4;
    int kmax = 0, nmax = 0;
    long weights = 0;
    for (auto& p : sh) kmax = std::max(kmax, p.first), nmax = std::max(nmax, p.second), weights += (long)p.first * p.second;
    kmax = std::max(kmax, 4096), nmax = std::max(nmax, 4096);  // the combine-like kernel reads and writes 4096 + 4096
    std::vector<uint32_t*> tr;
    for (int l = 0; l < LAYERS; ++l)
        for (auto& p : sh) {
            const long words = (long)(p.first / 16) * (p.second / 16) * 8 * K;
            uint32_t* t;
            CK(cudaMalloc(&t, words * 4));
            fill_random<<<1024, 256>>>(t, words, 99u + (unsigned)tr.size());
            tr.push_back(t);
        }
    __half *x, *su, *sv, *y;
    float* z;
    int* cnt;
    const int M = std::getenv("TUNE_M") != nullptr ? std::max(1, std::min(8, std::atoi(std::getenv("TUNE_M")))) : 1;
    CK(cudaMalloc(&x, (long)M * kmax * 2));
    CK(cudaMalloc(&su, kmax * 2));
    CK(cudaMalloc(&sv, nmax * 2));
    CK(cudaMalloc(&y, nmax * 2));
    CK(cudaMalloc(&z, 16L * nmax * 4));
    CK(cudaMalloc(&cnt, nmax / 128 * 4));
    CK(cudaMemset(x, 0, (long)M * kmax * 2));
    CK(cudaMemset(su, 0, kmax * 2));
    CK(cudaMemset(sv, 0, nmax * 2));
    CK(cudaMemset(z, 0, 16L * nmax * 4));
    CK(cudaMemset(cnt, 0, nmax / 128 * 4));
    // the extras' operands: a residual row, row sums, norm weight, gate, RoPE tables, a one-slot cache
    __half *res, *gate, *cache;
    float *ss, *nss, *nw, *rope;
    int64_t* slots;
    CK(cudaMalloc(&res, (long)M * nmax * 2));
    CK(cudaMalloc(&gate, (long)M * kmax * 2));
    CK(cudaMalloc(&cache, (long)M * nmax * 2));
    CK(cudaMalloc(&ss, 64));
    CK(cudaMalloc(&nss, 64));
    CK(cudaMalloc(&nw, kmax * 4));
    CK(cudaMalloc(&rope, 2 * 8 * 64 * 4));
    CK(cudaMalloc(&slots, 8 * 8));
    CK(cudaMemset(res, 0, (long)M * nmax * 2));
    CK(cudaMemset(gate, 0, (long)M * kmax * 2));
    CK(cudaMemset(ss, 0, 64));
    CK(cudaMemset(nss, 0, 64));
    CK(cudaMemset(nw, 0, kmax * 4));
    CK(cudaMemset(rope, 0, 2 * 8 * 64 * 4));
    CK(cudaMemset(slots, 0, 8 * 8));
    __half* xhb;  // TUNE_XH=rows: x transformed once per launch from that many rows (FusedArgs::xh_buf)
    CK(cudaMalloc(&xhb, 3L * M * kmax * 2));
    const int xh_rows = std::getenv("TUNE_XH") != nullptr ? std::atoi(std::getenv("TUNE_XH")) : 0;
    for (int pdl = 1; pdl >= 0; --pdl) {
        const float t = time_graph([&](int i, cudaStream_t st) {
            for (size_t j = 0; j < sh.size(); ++j) {
                exl3::FusedArgs a = fused_args();
                a.pdl = pdl;
                a.x = x;
                a.m = M;
                a.k_tiles = sh[j].first / 16;
                a.kt_per_chunk = kts[j];
                const std::string& ex = extras[j];
                if (ex == "c") {
                    const CombineLike c{z, y};
                    if (pdl) CK(exl3::launch_as_dependent(combine_like, 32, 128, st, c));
                    else combine_like<<<32, 128, 0, st>>>(c);
                    continue;
                }
                const uint32_t* t = tr[(i % LAYERS) * sh.size() + j];
                const int nt = sh[j].second / 16;
                if (ex.find('q') != std::string::npos) {  // q, k, v: n - 2 kv, kv, kv columns
                    const int kvt = nt / 6, qt = nt - 2 * kvt;
                    const long kt16 = a.k_tiles, w = 8L * K;
                    a.n_problems = 3;
                    a.p[0] = exl3::FusedProblem{t, su, sv, y, z, cnt, qt, 0};
                    a.p[1] = exl3::FusedProblem{t + kt16 * qt * w, su, sv, y, z + qt * 16, cnt + qt / 8, kvt, 0};
                    a.p[2] = exl3::FusedProblem{t + kt16 * (qt + kvt) * w, su, sv, y, z + (qt + kvt) * 16,
                                                cnt + (qt + kvt) / 8, kvt, 0};
                    a.rope_cos = rope, a.rope_sin = rope + 8 * 64, a.rope_half = 64, a.rope_mask = 3;
                    a.cache[1] = cache, a.cache[2] = cache, a.slots = slots;
                } else {
                    a.n_problems = 1;
                    a.p[0] = exl3::FusedProblem{t, su, sv, y, z, cnt, nt, 0};
                }
                if (ex.find('n') != std::string::npos)
                    a.norm_ss = nss, a.norm_w = nw, a.norm_eps = 1e-5f, a.norm_inv_dim = 1.f / sh[j].first;
                if (ex.find('g') != std::string::npos) a.gate = gate, a.act = exl3::FUSED_ACT_SILU;
                if (ex.find('r') != std::string::npos) a.res = res, a.res_ss = ss;
                a.xh_buf = xhb, a.xh_min_rows = xh_rows;
                exl3::launch_fused_t<K, CB>(a, st);
            }
        }, 16);
        std::printf("layer chain %s m=%d (%s): %.2f us per layer = %.2f Tweights/s\n", spec, M, pdl ? "PDL" : "plain",
                    t * 1e6, weights / t / 1e12);
    }
    for (auto* t : tr) CK(cudaFree(t));
    CK(cudaFree(x)); CK(cudaFree(su)); CK(cudaFree(sv)); CK(cudaFree(y)); CK(cudaFree(z)); CK(cudaFree(cnt));
    CK(cudaFree(res)); CK(cudaFree(gate)); CK(cudaFree(cache)); CK(cudaFree(ss)); CK(cudaFree(nss));
    CK(cudaFree(nw)); CK(cudaFree(rope)); CK(cudaFree(slots)); CK(cudaFree(xhb));
    return 0;
}

int main(int argc, char** argv) {
    std::vector<int> kts;
    for (int i = 1; i < argc; ++i) kts.push_back(std::atoi(argv[i]));
    if (kts.empty()) kts = {0, 8, 16, 24, 25, 26, 32};
    constexpr int K = TUNE_K, CB = TUNE_CB;
    // shapes k x n: the 8B MLP by default (the last: gate/up as one problem); TUNE_SHAPES="4096x6144,4096x4096"
    // (e.g. the 8B q/k/v group and o_proj) replaces them
    std::vector<std::pair<int, int>> shapes = {{4096, 14336}, {14336, 4096}, {4096, 28672}};
    if (const char* env = std::getenv("TUNE_SHAPES")) {
        shapes.clear();
        for (const char* s = env; *s;) {
            int k = 0, n = 0, used = 0;
            if (std::sscanf(s, "%dx%d%n", &k, &n, &used) != 2 || k % 128 || n % 128) {
                std::fprintf(stderr, "TUNE_SHAPES: bad entry at '%s' (want KxN, multiples of 128, comma-separated)\n", s);
                return 2;
            }
            shapes.push_back({k, n});
            s += used;
            if (*s == ',') ++s;
        }
    }
    int dev = 0, sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int occ_f = 0, occ_d = 0;
    // the fused kernel as the m = 1 linears run it with long chunks (the transposed deep-ring variant)
    constexpr int RS = exl3::fused_ring(K, true);
    const exl3::FusedVariant fv = exl3::fused_variant<K, CB>(exl3::FV_TR);
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_f, fv.kern, (int)fv.threads, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_d, exl3_bench::decode_only_kernel<K, CB>,
                                                     exl3_bench::DO_WARPS * 32, 0));
    cudaFuncAttributes fa{};
    CK(cudaFuncGetAttributes(&fa, fv.kern));
    cudaFuncAttributes fd{};
    CK(cudaFuncGetAttributes(&fd, exl3_bench::decode_only_kernel<K, CB>));
    std::printf("variant: ring stages %d (decode-only %d) | fused regs %d, smem %zu B, blocks/SM %d | decode-only regs %d, "
                "blocks/SM %d\n", RS, exl3::tr_ring_stages(K), fa.numRegs, fa.sharedSizeBytes, occ_f, fd.numRegs, occ_d);
    {  // the pre-decoding variant the launcher may pick
        const exl3::FusedVariant pv = exl3::fused_variant<K, CB>(exl3::FV_PD);
        cudaFuncAttributes fp{};
        CK(cudaFuncGetAttributes(&fp, pv.kern));
        std::printf("pre-decoding: chunks <= %d k tiles, %d decoded before the wait | regs %d, smem %zu B, blocks/SM %d | "
                    "mode %d\n", exl3::pd_ring(K), exl3::PD_STEPS, fp.numRegs, fp.sharedSizeBytes,
                    exl3::fused_occupancy<K, CB>(exl3::FV_PD),
                    predecode_opts().mode);
    }
    for (auto& sh : shapes) {
        const int k = sh.first, n = sh.second, kt = k / 16, nt = n / 16;
        const long words = (long)kt * nt * 8 * K;
        const long bytes = words * 4;
        const int copies = (int)std::max(2L, (3L * 60 * 1024 * 1024) / bytes + 1);
        uint32_t* tr;
        CK(cudaMalloc(&tr, bytes * copies));
        fill_random<<<1024, 256>>>(tr, words * copies, 1234u);
        std::vector<__half> hx(k), hsu(k), hsv(n);
        srand(7);
        for (int i = 0; i < k; ++i) {
            hx[i] = __float2half((rand() / (float)RAND_MAX - 0.5f) * 3.4f);
            hsu[i] = __float2half((rand() & 1) ? 1.0f : -1.0f);
        }
        for (int i = 0; i < n; ++i) hsv[i] = __float2half(((rand() & 1) ? 1.0f : -1.0f) * (0.02f + 0.01f * (i % 7)));
        __half *x, *su, *sv, *y;
        float *z, *sink;
        int* cnt;
        CK(cudaMalloc(&x, k * 2));
        CK(cudaMalloc(&su, k * 2));
        CK(cudaMalloc(&sv, n * 2));
        CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&z, 16L * n * 4));
        CK(cudaMalloc(&sink, 1 << 20));
        CK(cudaMalloc(&cnt, n / 128 * 4));
        CK(cudaMemcpy(x, hx.data(), k * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(su, hsu.data(), k * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(sv, hsv.data(), n * 2, cudaMemcpyHostToDevice));
        CK(cudaMemset(z, 0, 16L * n * 4));
        CK(cudaMemset(cnt, 0, n / 128 * 4));

        auto fused = [&](int kt_chunk, int i, cudaStream_t st, bool pdl = false) {
            exl3::FusedArgs a = fused_args();
            a.pdl = pdl;
            a.x = x;
            a.m = 1;
            a.k_tiles = kt;
            a.kt_per_chunk = kt_chunk;
            a.n_problems = 1;
            a.p[0] = exl3::FusedProblem{tr + (long)(i % copies) * words, su, sv, y, z, cnt, nt, 0};
            return exl3::launch_fused_t<K, CB>(a, st);
        };
        auto gemm = [&](int i, cudaStream_t st) {
            exl3::GemmArgs g{};
            g.x = x;
            g.trellis = tr + (long)(i % copies) * words;
            g.z = z;
            g.m = 1;
            g.k_tiles = kt;
            g.n_tiles = nt;
            g.kt_per_warp = 0;
            g.m0 = 0;
            return exl3::launch_gemm_t<K, CB, 1>(g, st);
        };
        // the decode-only kernel (bench/ext): the same loop decoding the same weights, no activations
        auto decode_only = [&](int i, cudaStream_t st, bool pdl) {
            exl3_bench::DecodeOnlyArgs d{};
            d.trellis = tr + (long)(i % copies) * words;
            d.sink = sink;
            d.k_tiles = kt;
            d.n_tiles = nt;
            d.kt_per_warp = 0;  // the launcher's split (about one wave of resident warps)
            return exl3_bench::launch_decode_only_t<K, CB>(d, st, pdl);
        };

        // correctness of the fused op (copy 0, one-wave chunking) against an fp64 host reference
        fused(0, 0, 0);
        CK(cudaDeviceSynchronize());
        CK(cudaGetLastError());
        std::vector<__half> hy(n);
        CK(cudaMemcpy(hy.data(), y, n * 2, cudaMemcpyDeviceToHost));
        __half* wh;
        CK(cudaMalloc(&wh, (long)k * n * 2));
        exl3::launch_reconstruct_t<K, CB>(tr, wh, kt, nt, 0);
        CK(cudaDeviceSynchronize());
        std::vector<__half> hw((long)k * n);
        CK(cudaMemcpy(hw.data(), wh, (long)k * n * 2, cudaMemcpyDeviceToHost));
        CK(cudaFree(wh));
        std::vector<double> xs(k), zr(n, 0.0);
        for (int i = 0; i < k; ++i) xs[i] = h2f(__float2half(h2f(hx[i]) * h2f(hsu[i])));
        for (int b = 0; b < k; b += 128) had128_host(&xs[b]);
        for (int i = 0; i < k; ++i) xs[i] = h2f(__float2half((float)xs[i]));
        for (int i = 0; i < k; ++i) {
            const double xi = xs[i];
            const __half* row = &hw[(long)i * n];
            for (int j = 0; j < n; ++j) zr[j] += xi * h2f(row[j]);
        }
        for (int b = 0; b < n; b += 128) had128_host(&zr[b]);
        double num = 0, den = 0;
        for (int j = 0; j < n; ++j) {
            const double r = zr[j] * h2f(hsv[j]);
            num += (h2f(hy[j]) - r) * (h2f(hy[j]) - r);
            den += r * r;
        }
        const double rel = std::sqrt(num / den);

        const double weights = (double)k * n;
        const float t_dec = time_graph([&](int i, cudaStream_t st) { decode_only(i, st, false); });
        const float t_inner = time_graph([&](int i, cudaStream_t st) { gemm(i, st); });
        std::printf("%5dx%-5d  rel.err %.2e | decode-only (same shape) %.2f us = %.2f Tw/s | inner split-k GEMM %.2f us (%.0f%%)\n",
                    k, n, rel, t_dec * 1e6, weights / t_dec / 1e12, t_inner * 1e6, 100 * t_dec / t_inner);
        // In the engine the linear runs as a programmatic dependent (EXL3_PDL): its blocks start while the
        // kernel before it drains. Back-to-back launches, both kernels as dependents, show what is left of
        // the per-launch fixed cost once the launches overlap.
        const float t_dec_pdl = time_graph([&](int i, cudaStream_t st) { decode_only(i, st, true); });
        const float t_pdl = time_graph([&](int i, cudaStream_t st) { fused(0, i, st, true); });
        std::printf("   with PDL: decode-only %.2f us, fused kt=0 %.2f us -> %.1f%% of decode-only with PDL, %.1f%% of "
                    "plain decode-only\n", t_dec_pdl * 1e6, t_pdl * 1e6, 100 * t_dec_pdl / t_pdl, 100 * t_dec / t_pdl);
        for (int c : kts) {
            int used = 0;
            const float t = time_graph([&](int i, cudaStream_t st) { used = fused(c, i, st); });
            std::printf("   fused kt=%-2d (used %2d, %4ld blocks): %.2f us  -> %.1f%% of decode-only (same shape)\n", c, used,
                        (long)(nt / 8) * ((kt + used - 1) / used), t * 1e6, 100 * t_dec / t);
        }
        if (rel > 1e-3) {
            std::printf("FAILED: fused output off by %.2e relative\n", rel);
            return 1;
        }
        CK(cudaFree(tr)); CK(cudaFree(x)); CK(cudaFree(su)); CK(cudaFree(sv)); CK(cudaFree(y));
        CK(cudaFree(z)); CK(cudaFree(sink)); CK(cudaFree(cnt));
    }
    if (std::getenv("TUNE_CHAIN") != nullptr) return layer_chain<K, CB>(std::getenv("TUNE_CHAIN"));
    return 0;
}
