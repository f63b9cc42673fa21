// EXL3 tail-biting Viterbi tile encoder, CPU (multithreaded over tiles, SIMD over trellis nodes).
//
// Op: exl3::viterbi_encode(Tensor tiles, Tensor lut, int K, int mode=0) -> Tensor
//   tiles: fp32 [N, 256] in sequence order; lut: fp32 [65536] codebook values (state -> value);
//   returns int32 [N, 256] full 16-bit states (0..65535). mode picks the survivor storage
//   (0 = per-K default, 1 = survivor table, 2 = cost history); all modes give identical states.
//
// The arithmetic is defined in exl3_core/quant/exl3/viterbi.py (module docstring) and this file
// follows it operation for operation, so the result is bit-identical to the torch reference:
//   d = fp32(lut[s] - w); c = fma(d, d, D[pred])   (d*d + D rounded once, as fmaf / __fmaf_rn)
//   D'[n] = min over a = 0..2^K-1 ascending, replacing only on strict '<' (lowest a wins ties).
//
// Layout: node n = low 16-K bits of the state; candidate a (top K bits) gives state
// s = a * NN + n (NN = 2^(16-K)) and predecessor node s >> K = a * M + (n >> K) (M = 2^(16-2K)).
// For a fixed a, lut[s] is contiguous over n, so one SIMD vector covers kLanes consecutive nodes; the
// predecessor costs are a broadcast (2^K >= kLanes) or a lane permute of a contiguous load.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kSeq = 256;       // weights per tile
constexpr int kStates = 65536;  // 16-bit trellis states
// SIMD width in floats: one native register, because a 64-byte vector type on an AVX2-only build makes gcc
// scalarise the compare/select.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kGroup = 4;       // independent accumulator chains per inner iteration (hides latency)
constexpr int kBlock = kLanes * kGroup;  // nodes per inner block
constexpr int kPad = kLanes;    // slack after D arrays: the permuted predecessor loads may read past NN

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint8_t vb __attribute__((vector_size(kLanes)));

inline vf load_vf(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

// x - 0 == x exactly (also for -0), so gcc folds this to a plain broadcast; "vf{} + x" keeps an add.
inline vf splat(float x) { return x - vf{}; }

// c = fma(d, d, D): d*d + D rounded once (the defined candidate cost). Hardware FMA when the build
// targets it; otherwise the exact libm fmaf per lane (slow but identical).
inline vf fma_dd(vf d, vf D) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)d, (__m512)d, (__m512)D);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)d, (__m256)d, (__m256)D);
#else
    vf r;
    for (int i = 0; i < kLanes; ++i) r[i] = std::fma(d[i], d[i], D[i]);
    return r;
#endif
}

// Predecessor costs for the kLanes nodes n0.. and candidate a: D[a*M + ((n0 + lane) >> K)].
template <int K>
inline vf load_pred(const float* Da, int n0) {
    if constexpr ((1 << K) >= kLanes) {
        return splat(Da[n0 >> K]);  // all lanes share one predecessor
    } else {
        vi idx;
        for (int i = 0; i < kLanes; ++i) idx[i] = i >> K;  // folded to a constant by the compiler
        return __builtin_shuffle(load_vf(Da + (n0 >> K)), idx);
    }
}

// One trellis step over all nodes: Dn[n] = min_a fma(d, d, Dp[a*M + (n>>K)]) with
// d = lut[a*NN + n] - w. lutp is the LUT permuted into this loop's read order (see encode_all), so
// it streams sequentially. With Surv, the lowest arg-min a of every node goes to sv[n]; without,
// only the costs are kept (one min per candidate instead of compare + two blends) and trace_arg
// recovers the survivors of the traced path later.
template <int K, bool Surv>
void step(const float* __restrict Dp, float* __restrict Dn, uint8_t* __restrict sv,
          const float* __restrict lutp, float w) {
    constexpr int NN = 1 << (16 - K);
    constexpr int L = 1 << K;
    constexpr int M = 1 << (16 - 2 * K);
    const vf wv = splat(w);
    const vf inf = splat(std::numeric_limits<float>::infinity());
    for (int n0 = 0; n0 < NN; n0 += kBlock) {
        vf best[kGroup];
        vi arg[kGroup];
#pragma GCC unroll 8
        for (int g = 0; g < kGroup; ++g) {
            best[g] = inf;
            arg[g] = vi{};
        }
        for (int a = 0; a < L; ++a) {
            const float* la = lutp + ((size_t)n0 * L + a * kBlock);
            const float* Da = Dp + a * M;
            const vi av = vi{} + a;
#pragma GCC unroll 8
            for (int g = 0; g < kGroup; ++g) {
                const vf d = load_vf(la + g * kLanes) - wv;
                const vf c = fma_dd(d, load_pred<K>(Da, n0 + g * kLanes));
                if constexpr (Surv) {
                    const vi m = c < best[g];  // strict: the lowest a wins ties
                    best[g] = m ? c : best[g];
                    arg[g] = m ? av : arg[g];
                } else {
                    best[g] = c < best[g] ? c : best[g];
                }
            }
        }
#pragma GCC unroll 8
        for (int g = 0; g < kGroup; ++g) {
            std::memcpy(Dn + n0 + g * kLanes, &best[g], sizeof(vf));
            if constexpr (Surv) {
                const vb s = __builtin_convertvector(arg[g], vb);
                std::memcpy(sv + n0 + g * kLanes, &s, sizeof(vb));
            }
        }
    }
}

// Survivor of node n at a step with input w and previous costs Dp: the lowest a whose candidate is
// minimal, computed with exactly the operations of step().
template <int K>
int trace_arg(const float* Dp, const float* lut, float w, int n) {
    constexpr int NN = 1 << (16 - K);
    constexpr int L = 1 << K;
    float best = std::numeric_limits<float>::infinity();
    int arg = 0;
    for (int a = 0; a < L; ++a) {
        const int s = a * NN + n;
        const float d = lut[s] - w;
        const float c = std::fma(d, d, Dp[s >> K]);
        if (c < best) {
            best = c;
            arg = a;
        }
    }
    return arg;
}

// Survivor storage per K. History mode keeps every step's cost array (fp32, NN per step) and
// recomputes survivors during the traceback; it does a third of the inner-loop work but writes 4x
// more memory per step, which for K <= 2 (NN >= 16384, 16+ MiB per pass) spills out of the caches.
// Both modes give bit-identical states. With AVX-512 history is faster for K >= 3 and survivors for
// K <= 2; 8-lane (AVX2) builds always take history, which wins at every K there.
template <int K>
bool use_history(int64_t mode) {
    return mode == 0 ? (K >= 3 || kLanes < 16) : mode == 2;
}

struct Workspace {
    std::vector<float> hist;    // history mode: [257][NN + kPad], slot i+1 = costs after step i
    std::vector<float> d0, d1;  // survivor mode: two cost arrays
    std::vector<uint8_t> surv;  // survivor mode: [256][NN] survivor a per position and node
};

template <int K>
void init_costs(float* D, int forced) {
    constexpr int NN = 1 << (16 - K);
    if (forced < 0) {
        std::fill(D, D + NN + kPad, 0.0f);
    } else {
        std::fill(D, D + NN + kPad, std::numeric_limits<float>::infinity());
        D[forced] = 0.0f;
    }
}

// Viterbi over seq[0..255] from start node `forced` (< 0: every node starts at cost 0), then trace
// back from end node `end` (< 0: the first arg-min end node) down to position `stop`, writing the
// states of positions stop..255 to states[] (when non-null). Returns the node of position stop-1.
template <int K>
int viterbi(Workspace& ws, bool hist, const float* seq, const float* lut, const float* lutp, int forced, int end,
            int stop, int32_t* states) {
    constexpr int NN = 1 << (16 - K);
    constexpr int NS = NN + kPad;
    const float* D;
    if (hist) {
        float* H = ws.hist.data();
        init_costs<K>(H, forced);
        for (int i = 0; i < kSeq; ++i)
            step<K, false>(H + (size_t)i * NS, H + (size_t)(i + 1) * NS, nullptr, lutp, seq[i]);
        D = H + (size_t)kSeq * NS;
    } else {
        float* Dp = ws.d0.data();
        float* Dn = ws.d1.data();
        init_costs<K>(Dp, forced);
        for (int i = 0; i < kSeq; ++i) {
            step<K, true>(Dp, Dn, ws.surv.data() + (size_t)i * NN, lutp, seq[i]);
            std::swap(Dp, Dn);
        }
        D = Dp;
    }
    int n = end;
    if (n < 0) {
        n = 0;
        for (int j = 1; j < NN; ++j)
            if (D[j] < D[n]) n = j;
    }
    for (int i = kSeq - 1; i >= stop; --i) {
        const int a = hist ? trace_arg<K>(ws.hist.data() + (size_t)i * NS, lut, seq[i], n)
                           : ws.surv[(size_t)i * NN + n];
        const int s = a * NN + n;
        if (states) states[i] = s;
        n = s >> K;
    }
    return n;
}

template <int K>
void encode_tile(Workspace& ws, bool hist, const float* w, const float* lut, const float* lutp, int32_t* out) {
    // (1)+(2) unconstrained pass over the sequence rotated by 128; the arg-min end node traced back
    // to rotated index 127 (= natural position 255) gives the overlap, state_255's low 16-K bits
    float rot[kSeq];
    for (int i = 0; i < kSeq; ++i) rot[i] = w[(i + kSeq / 2) % kSeq];
    const int overlap = viterbi<K>(ws, hist, rot, lut, lutp, -1, -1, kSeq / 2, nullptr);
    // (3)+(4) natural order, start node forced to the overlap, traced back from the same node:
    // state_0 >> K == overlap == state_255 & mask, the tail-biting condition
    viterbi<K>(ws, hist, w, lut, lutp, overlap, overlap, 0, out);
}

template <int K>
void encode_all(const float* tiles, const float* lut, int32_t* out, int64_t n_tiles, int64_t mode) {
    const bool hist = use_history<K>(mode);
    constexpr int NN = 1 << (16 - K);
    constexpr int L = 1 << K;
    // LUT permuted into step()'s read order [node block][a][kBlock nodes], so every step streams it
    // sequentially instead of through 2^K rows 2^(16-K) floats apart.
    std::vector<float> lutp((size_t)kStates);
    for (int n0 = 0; n0 < NN; n0 += kBlock)
        for (int a = 0; a < L; ++a)
            for (int j = 0; j < kBlock; ++j) lutp[(size_t)n0 * L + a * kBlock + j] = lut[a * NN + n0 + j];
    at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
        Workspace ws;
        if (hist) {
            ws.hist.resize((size_t)(kSeq + 1) * (NN + kPad));
        } else {
            ws.d0.resize(NN + kPad);
            ws.d1.resize(NN + kPad);
            ws.surv.resize((size_t)kSeq * NN);
        }
        for (int64_t t = begin; t < end; ++t)
            encode_tile<K>(ws, hist, tiles + t * kSeq, lut, lutp.data(), out + t * kSeq);
    });
}

at::Tensor viterbi_encode(const at::Tensor& tiles, const at::Tensor& lut, int64_t K, int64_t mode) {
    TORCH_CHECK(K >= 1 && K <= 8, "exl3::viterbi_encode: K=", K, " is outside 1..8");
    TORCH_CHECK(mode >= 0 && mode <= 2, "exl3::viterbi_encode: mode=", mode,
                " is invalid (0 = per-K default, 1 = survivor table, 2 = cost history)");
    TORCH_CHECK(tiles.device().is_cpu() && lut.device().is_cpu(),
                "exl3::viterbi_encode (csrc/cpu/viterbi.cpp): tiles and lut must be CPU tensors");
    TORCH_CHECK(tiles.scalar_type() == at::kFloat && tiles.dim() == 2 && tiles.size(1) == kSeq,
                "exl3::viterbi_encode: tiles must be float32 [N, 256] (sequence order), got ",
                tiles.scalar_type(), " ", tiles.sizes());
    TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.dim() == 1 && lut.size(0) == kStates,
                "exl3::viterbi_encode: lut must be float32 [65536] (codebook values per state), got ",
                lut.scalar_type(), " ", lut.sizes());
    const at::Tensor t = tiles.contiguous();
    const at::Tensor l = lut.contiguous();
    // Finite and within fp16 range keeps every path cost finite, so +inf only marks the forced
    // pass's unreachable nodes and never ties with a real path.
    TORCH_CHECK(t.numel() == 0 || t.abs().le(65504.0).all().item<bool>(),
                "exl3::viterbi_encode: tiles hold non-finite values or |w| > 65504");
    TORCH_CHECK(l.isfinite().all().item<bool>(), "exl3::viterbi_encode: lut holds non-finite values");
    at::Tensor out = at::empty({t.size(0), kSeq}, t.options().dtype(at::kInt));
    const float* tp = t.data_ptr<float>();
    const float* lp = l.data_ptr<float>();
    int32_t* op = out.data_ptr<int32_t>();
    const int64_t n = t.size(0);
    switch (K) {
        case 1: encode_all<1>(tp, lp, op, n, mode); break;
        case 2: encode_all<2>(tp, lp, op, n, mode); break;
        case 3: encode_all<3>(tp, lp, op, n, mode); break;
        case 4: encode_all<4>(tp, lp, op, n, mode); break;
        case 5: encode_all<5>(tp, lp, op, n, mode); break;
        case 6: encode_all<6>(tp, lp, op, n, mode); break;
        case 7: encode_all<7>(tp, lp, op, n, mode); break;
        case 8: encode_all<8>(tp, lp, op, n, mode); break;
    }
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3, m) {
    m.def("viterbi_encode(Tensor tiles, Tensor lut, int K, int mode=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3, CPU, m) {
    m.impl("viterbi_encode", &viterbi_encode);
}
