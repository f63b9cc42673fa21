// Host emulator of the CUDA Viterbi encoder: runs encode_block() from viterbi_kernel.cuh, the very
// code the GPU kernel runs, with every CUDA thread of a block as a user-space fiber (ucontext).
// __syncthreads is a round-robin switch to the next fiber (all fibers run to the barrier before any
// passes it); a warp shuffle is an exchange through an array between two barriers.
//
// Not part of the extension (setup.py compiles csrc/**/*.cpp and *.cu only). The test
// tests/core/test_viterbi_cuda_emu.py builds it with g++ as a plain shared library and compares the
// states with the CPU op, so the kernel's indexing and reductions are checked without a GPU.
//
// C entry point: exl3_viterbi_emu(K, tiles fp32 [n,256], n, lut fp16 bits [65536], out int32 [n,256],
// nblocks) -> 0 on success. Blocks run one after another; nblocks emulates the grid stride.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "viterbi_kernel.cuh"

namespace {

using namespace exl3vit;

float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31;
    const int exp = (h >> 10) & 0x1f;
    const uint32_t man = h & 0x3ff;
    float v;
    if (exp == 0) {
        v = std::ldexp((float)man, -24);  // subnormal (exact)
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = std::ldexp((float)(man | 0x400), exp - 25);
    }
    uint32_t b;
    std::memcpy(&b, &v, 4);
    b |= sign;
    std::memcpy(&v, &b, 4);
    return v;
}

struct Fibers {
    std::vector<ucontext_t> uc;
    std::vector<std::vector<uint8_t>> stacks;
    ucontext_t main_uc;
    std::vector<uint32_t> xch;
    std::vector<uint8_t> smem;  // 16-byte aligned view below
    uint8_t* smem_aligned = nullptr;
};

struct HostCx {
    Fibers* f;
    int t;
    int tid() const { return t; }
    uint8_t* smem() { return f->smem_aligned; }
    void sync() { swapcontext(&f->uc[t], &f->uc[(t + 1) % kThreads]); }
    template <int N>
    void shfl_xor_n(uint32_t (&v)[N], int m) {
        static_assert(N <= 64, "exchange slot too small");
        std::memcpy(&f->xch[(size_t)t * 64], v, sizeof(v));
        sync();
        std::memcpy(v, &f->xch[(size_t)(t ^ m) * 64], sizeof(v));
        sync();
    }
    float sub(float a, float b) { return a - b; }
    float fma(float a, float b, float c) { return std::fma(a, b, c); }
    uint32_t bits(float x) {
        uint32_t u;
        std::memcpy(&u, &x, 4);
        return u;
    }
    float inf() { return INFINITY; }
    void load8h(const uint16_t* p, float (&o)[kCh]) {
        for (int k = 0; k < kCh; ++k) o[k] = half_to_float(p[k]);
    }
    void store8f(float* p, const uint32_t* b) { std::memcpy(p, b, kCh * 4); }
    void store8b(uint8_t* p, const uint32_t* a) {
        for (int k = 0; k < kCh; ++k) p[k] = (uint8_t)a[k];
    }
};

struct Run {
    Fibers* f;
    Args args;
    int K;
};
Run* g_run = nullptr;

template <int K>
void fiber_main(int tid) {
    HostCx cx{g_run->f, tid};
    encode_block<K>(cx, g_run->args);
}

void fiber_entry(int K, int tid) {
    switch (K) {
        case 1: fiber_main<1>(tid); break;
        case 2: fiber_main<2>(tid); break;
        case 3: fiber_main<3>(tid); break;
        case 4: fiber_main<4>(tid); break;
        case 5: fiber_main<5>(tid); break;
        case 6: fiber_main<6>(tid); break;
        case 7: fiber_main<7>(tid); break;
        case 8: fiber_main<8>(tid); break;
    }
}

template <int K>
void sizes(size_t& smem, size_t& surv, size_t& dscr) {
    smem = smem_bytes<K>();
    surv = surv_slot_bytes<K>();
    dscr = dscratch_slot_floats<K>();
}

}  // namespace

extern "C" int exl3_viterbi_emu(int K, const float* tiles, long n, const uint16_t* lut, int32_t* out, int nblocks) {
    if (K < 1 || K > 8 || nblocks < 1) return 1;
    size_t smem = 0, surv = 0, dscr = 0;
    switch (K) {
        case 1: sizes<1>(smem, surv, dscr); break;
        case 2: sizes<2>(smem, surv, dscr); break;
        case 3: sizes<3>(smem, surv, dscr); break;
        case 4: sizes<4>(smem, surv, dscr); break;
        case 5: sizes<5>(smem, surv, dscr); break;
        case 6: sizes<6>(smem, surv, dscr); break;
        case 7: sizes<7>(smem, surv, dscr); break;
        case 8: sizes<8>(smem, surv, dscr); break;
    }
    std::vector<uint8_t> surv_buf(surv * nblocks);
    std::vector<float> dscr_buf(dscr * nblocks + 1);
    Fibers f;
    f.uc.resize(kThreads);
    f.stacks.assign(kThreads, std::vector<uint8_t>(1 << 16));
    f.xch.assign((size_t)kThreads * 64, 0);
    for (int b = 0; b < nblocks; ++b) {
        // fresh, poisoned shared memory per block: a read before a write shows up as a mismatch
        f.smem.assign(smem + 16, 0xA5);
        f.smem_aligned = f.smem.data() + ((16 - (reinterpret_cast<uintptr_t>(f.smem.data()) & 15)) & 15);
        Run run{&f, Args{tiles, (int64_t)n, lut, out, surv_buf.data(), dscr_buf.data(), b, nblocks}, K};
        g_run = &run;
        for (int t = 0; t < kThreads; ++t) {
            getcontext(&f.uc[t]);
            f.uc[t].uc_stack.ss_sp = f.stacks[t].data();
            f.uc[t].uc_stack.ss_size = f.stacks[t].size();
            // a finished fiber hands over to the next one, which finishes too; the last returns here
            f.uc[t].uc_link = t + 1 < kThreads ? &f.uc[t + 1] : &f.main_uc;
            makecontext(&f.uc[t], (void (*)())fiber_entry, 2, K, t);
        }
        swapcontext(&f.main_uc, &f.uc[0]);
        g_run = nullptr;
    }
    return 0;
}
