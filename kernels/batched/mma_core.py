"""The tensor-core core of the batched families: one warp's mma rounds over a k range, for any weight format.

Shared by the tensor-core pair (:mod:`kernels.batched.mma`) and the per-pair pair (:mod:`kernels.batched.pairs`),
placed after the format's loader (:mod:`kernels.batched.loaders`), which supplies the A rows' types, widening,
addressing and scales. Reads ``GB_KSPLIT`` (the k ranges of the split chains) and ``DOWN_WAITS_LATE``.
"""

from kernels.device_helpers import MMA_HELPERS

CODE = r"""
// ==== the tensor-core core (kernels/batched/mma_core.py) ====
// ------------------------------------------------------------------------------------------------
// The tensor-core kernels (sm_80+): the FMA pair's ownership -- a warp owns output rows of ONE
// expert for ALL its pairs -- but the dots run on mma.sync.m16n8k16 (bf16 x bf16 products, FP32
// accumulation in the tensor core; no intermediate quantization beyond the one bf16 rounding of the
// intermediate, as in the FMA kernels; the summation order inside an mma differs from a lane's FMA chain).
//   A = 16 weight rows x 16 k, B = 16 k x 8 pairs, C = 16 x 8 FP32 accumulators, 4 per lane.
//   k is permuted so that every lane loads 16 contiguous bytes: in 32-wide k block j, lane l (g = l / 4,
//   q = l % 4) loads elements 32j + 8q .. 32j + 8q + 7 (16-byte chunk 4j + q) of its two A rows and of
//   the row of B column g. Words 0, 1 feed the block's first mma (a0/a2 and b0/b1: logical k 2q, 2q+1 and
//   2q+8, 2q+9), words 2, 3 the second: every lane maps logical k to physical k the same way for A and
//   B, so each mma sums the products of matching elements.
//   C: lane (g, q) holds rows g and g + 8 of columns 2q and 2q + 1.
// ------------------------------------------------------------------------------------------------
""" + MMA_HELPERS + r"""
#define MMA_KB (4 * MMA_HALVES)                      // chunks of 8 values per k block: 32- or 64-wide

// A tensor-core warp's two A rows of one expert (rows g and g + 8 of its 16) and their scale rows along k: w13's
// gate row i and up row i (w13_rows), or w2's rows h_lo and h_hi (w2_rows)
struct ARows { const a_chunk_t* lo; const a_chunk_t* hi; const mma_scale_t* scale_lo; const mma_scale_t* scale_hi; };
// A row's pointer in its expert: the loader's offsets (rows, or 16-row tiles; in values, VALUES_PER_WEIGHT a stored
// element), and its scale rows (the loader's)
__device__ __forceinline__ ARows w13_rows(const weight_t* w13, const mma_scale_t* s13, int e, int i, int hidden,
                                          int inter) {
    MMA_SCALE_GEOMETRY(hidden, inter);                               // the loader's: its scale blocks along H and I
    const size_t expert = (size_t)e * 2 * inter * hidden;
    const size_t gate = expert + w13_gate_offset(i, hidden);
    const size_t up = w13_up_offset(gate, i, hidden, inter);
    return {reinterpret_cast<const a_chunk_t*>(w13 + gate / VALUES_PER_WEIGHT),
            reinterpret_cast<const a_chunk_t*>(w13 + up / VALUES_PER_WEIGHT),
            mma_w13_scale_row(s13, e, i, false), mma_w13_scale_row(s13, e, i, true)};
}
__device__ __forceinline__ size_t w2_row(int e, int h, int hidden, int inter) {
    return (size_t)e * hidden * inter + w2_row_offset(h, inter);
}
__device__ __forceinline__ ARows w2_rows(const weight_t* w2, const mma_scale_t* s2, int e, int h_lo, int h_hi,
                                         int hidden, int inter) {
    MMA_SCALE_GEOMETRY(hidden, inter);
    return {reinterpret_cast<const a_chunk_t*>(w2 + w2_row(e, h_lo, hidden, inter) / VALUES_PER_WEIGHT),
            reinterpret_cast<const a_chunk_t*>(w2 + w2_row(e, h_hi, hidden, inter) / VALUES_PER_WEIGHT),
            mma_w2_scale_row(s2, e, h_lo), mma_w2_scale_row(s2, e, h_hi)};
}
// A format whose A fragments take no scale (bf16; fp8 scales the mma's partials): the core's a_fragment(load, h,
// scale) is the loader's a_fragment(load, h). A format that scales each lane's A values before the mma (mxfp4) defines
// A_SCALE(j, t, row) -- the scale of k block j, row tile t, rows g (row 0) or g + 8 (1), loaded by LOAD_ROUND_SCALES
// -- and its own three-argument a_fragment.
// A format with a float32 scale per expert (nvfp4) applies it after the mma, where a kernel's dot is complete:
// GLOBAL_OF(g, e) reads expert e's from the kernel's argument g, WITH_GLOBAL(v, global) multiplies; the others
// neither read nor multiply.
#ifndef WITH_GLOBAL
#define GLOBAL_OF(g, e) 1.0f
#define WITH_GLOBAL(v, global) (v)
#endif
#ifndef A_SCALE
#define A_SCALE(j, t, row) 0u
template <typename L>
__device__ __forceinline__ uint4 a_fragment(const L& load, int h, u32 scale) {
    (void)scale;
    return a_fragment(load, h);
}
#endif

// Range r of GB_KSPLIT over `chunks` chunks of 8 values: whole k blocks, ceil(chunks / GB_KSPLIT) rounded up to
// MMA_KB chunks each (the last ranges may be short or empty); H (and the knobs) alone fix it.
__device__ __forceinline__ void k_range(int chunks, int r, int& begin, int& end) {
    const int size = ((chunks + GB_KSPLIT - 1) / GB_KSPLIT + MMA_KB - 1) / MMA_KB * MMA_KB;
    begin = min(r * size, chunks);
    end = min(begin + size, chunks);
}

// GB_SHARE: a group of warps' shared A fragments (the group's region of the block's a_share, two round
// buffers of UNROLL k blocks x MMA_HALVES x RT row tiles x (rows g, rows g + 8) x 32 lanes), this warp's place in
// the group and the round's buffer. Unused (nullptr) elsewhere.
struct AShare { uint4* group; int member, members, parity; };
// A share group's seat for warp w of a block of `warps`: its m (members) block rows from a - place hold
// block_in_tile x m blocks of warps / m output units (8-neuron groups, 16-row tiles) x the m tiles, so warp w runs
// unit `set` = w / m of this block (`first`: its index from the group's first block) on tile w mod m of the group.
struct ShareSeat { int set, member, first; };
__device__ __forceinline__ ShareSeat share_seat(int block_in_tile, int members, int place, int warps) {
    const int w = threadIdx.x >> 5, set = w / members;
    return {set, w % members, (block_in_tile * members + place) * (warps / members) + set};
}
#define SHARE_ROUND(unroll, rt) ((unroll) * MMA_HALVES * (rt) * 2 * 32)   // uint4s of one round buffer

// One round of a warp's k range (below): UNROLL k blocks from chunk c0. CHECKED: some k block may lie past c_end
// (a lane past the end loads chunk 0 and uses zeros); unchecked rounds are whole, with no masking (the bounds
// selects were ~15 % of an FP8 round's instructions).
// RT row tiles (tiles[t]: rows 16t + g and 16t + g + 8 of the warp's) share each B fragment; acc[t * NB + nb].
// SHARED (GB_SHARE): the warp loads and widens only its group's k blocks j with j mod m == member (before
// a dependent B's wait, as its own A loads would be) into the round's buffer; after the block barrier every member
// reads all UNROLL k blocks' fragments there.
template <int UNROLL, int NB, bool COLS_DEP, bool CHECKED, int RT = 1, bool SHARED = false>
__device__ __forceinline__ void mma_round(float (&acc)[RT * NB][4], float (&part)[RT * NB][4],
                                          const ARows (&tiles)[RT], const uint4* const (&cols)[NB], int c0, int c_end,
                                          int q, bool& waited, AShare* share = nullptr) {
    constexpr int OWN = SHARED ? (UNROLL + 1) / 2 : UNROLL;          // A loads per lane: SHARED, its k blocks only
    a_load_t lo[OWN][RT], hi[OWN][RT];                                // (groups of 2 or 4: at most half of them)
    uint4 col[UNROLL][NB][MMA_HALVES];
    ROUND_SCALES(UNROLL, RT);                                        // the loader's: the round's scales, if any
    float (&sums)[RT * NB][4] = mma_sums(acc, part);                 // where the mma accumulate (acc, or part)
    #pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
        const int c = c0 + MMA_KB * j + MMA_HALVES * q;              // the lane's first chunk of k block j
        const bool ok = !CHECKED || c < c_end;
        if constexpr (!SHARED) {
            #pragma unroll
            for (int t = 0; t < RT; ++t) {
                lo[j][t] = ldg_chunk(reinterpret_cast<const a_load_t*>(tiles[t].lo), a_index(c / MMA_HALVES), ok);
                hi[j][t] = ldg_chunk(reinterpret_cast<const a_load_t*>(tiles[t].hi), a_index(c / MMA_HALVES), ok);
            }
        }
        LOAD_ROUND_SCALES(j, c0 + MMA_KB * j);                       // scaled formats: k block j's scales
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int h = 0; h < MMA_HALVES; ++h)
                if (!COLS_DEP) col[j][nb][h] = ldg_chunk(cols[nb], c + h, ok);
    }
    if constexpr (SHARED) {
        // own k block i is the round's k block j = i m + member (warp-uniform)
        #pragma unroll
        for (int i = 0; i < OWN; ++i) {
            const int j = i * share->members + share->member;
            const int c = c0 + MMA_KB * j + MMA_HALVES * q;
            const bool ok = j < UNROLL && (!CHECKED || c < c_end);
            #pragma unroll
            for (int t = 0; t < RT; ++t) {
                lo[i][t] = ldg_chunk(reinterpret_cast<const a_load_t*>(tiles[t].lo), a_index(c / MMA_HALVES), ok);
                hi[i][t] = ldg_chunk(reinterpret_cast<const a_load_t*>(tiles[t].hi), a_index(c / MMA_HALVES), ok);
            }
        }
    }
    if (COLS_DEP) {
        wait_once(waited);
        #pragma unroll
        for (int j = 0; j < UNROLL; ++j) {
            const int c = c0 + MMA_KB * j + MMA_HALVES * q;
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb)
                #pragma unroll
                for (int h = 0; h < MMA_HALVES; ++h)
                    col[j][nb][h] = ld_dep_chunk(cols[nb], c + h, !CHECKED || c < c_end);
        }
    }
    uint4* shared_a = nullptr;                                       // SHARED: this round's buffer
    if constexpr (SHARED) {                                          // widening into the buffer
        const int lane = threadIdx.x & 31;
        shared_a = share->group + share->parity * SHARE_ROUND(UNROLL, RT);
        share->parity ^= 1;
        #pragma unroll
        for (int i = 0; i < OWN; ++i) {
            const int j = i * share->members + share->member;
            if (j >= UNROLL) break;                                  // warp-uniform
            #pragma unroll
            for (int h = 0; h < MMA_HALVES; ++h)
                #pragma unroll
                for (int t = 0; t < RT; ++t) {
                    const int at = (((j * MMA_HALVES + h) * RT + t) * 2) * 32 + lane;
                    shared_a[at] = a_fragment(lo[i][t], h, A_SCALE(j, t, 0));
                    shared_a[at + 32] = a_fragment(hi[i][t], h, A_SCALE(j, t, 1));
                }
        }
        __syncthreads();  // the group's fragments are in; the other buffer's last readers have passed this barrier
    } else {
        sums[0][0] += __uint_as_float(all_loads_arrived(lo) | all_loads_arrived(hi));  // += 0.0f, before any mma
    }
    #pragma unroll
    for (int j = 0; j < UNROLL; ++j) {
        #pragma unroll
        for (int h = 0; h < MMA_HALVES; ++h) {
            uint4 b[NB];
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) b[nb] = b_fragment<COLS_DEP>(col[j][nb][h]);
            #pragma unroll
            for (int t = 0; t < RT; ++t) {
                uint4 a_lo, a_hi;
                if constexpr (SHARED) {
                    const int at = (((j * MMA_HALVES + h) * RT + t) * 2) * 32 + (threadIdx.x & 31);
                    a_lo = shared_a[at];
                    a_hi = shared_a[at + 32];
                } else {
                    a_lo = a_fragment(lo[j][t], h, A_SCALE(j, t, 0));
                    a_hi = a_fragment(hi[j][t], h, A_SCALE(j, t, 1));
                }
                #pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
                    mma_k32(sums[t * NB + nb], a_lo, a_hi, b[nb]);
                }
            }
        }
        APPLY_ROUND_SCALES(j);                                       // scaled formats: a block's partial into acc
    }
}

// A warp's k range (chunks c_begin .. c_end - 1, c_begin a multiple of MMA_KB), shared by both tensor-core
// kernels: acc[nb] (zeroed here) = A rows g / g + 8 (rows_lo / rows_hi) times B column g of 8-pair block nb
// (cols[nb]). Lane q loads chunk(s) MMA_KB j + MMA_HALVES q (+ 1) of each k block j; UNROLL k blocks of loads are in
// flight per lane before the round's first mma. ROUNDS: WHOLE_ROUNDS runs whole rounds unmasked and a last partial
// round masked -- on the H200 6-10 % faster for FP8 weights and 3-9 % for the bf16 tensor-core path, but 2-3 % slower
// in the bf16 grouped path's split-chain gate_up and grouped down, which keep MASKED_ROUNDS (every round masked);
// ONLY_WHOLE_ROUNDS compiles no masked round at all, for a range the host knows to be whole rounds (the bf16 grouped
// down with DB_WHOLE_RANGES: 1-2 % faster with one 8-pair block, 3 % slower with two; the split-chain gate_up was
// 2-4 % slower that way: results/sweep-2026-12-02-whole-ranges-*.json).
// COLS_DEP: B is the previous kernel's output (down's intermediate), loaded through ld_dep after the round's A
// loads and after wait_once (the first round's A loads are issued before the PDL wait).
// A scaled format's loader (RoundScales) reads the rows' scales along k and scales the mma's partial (part) into acc
// where a scale block or the range ends.
#define MASKED_ROUNDS 0
#define WHOLE_ROUNDS 1
#define ONLY_WHOLE_ROUNDS 2
// RT row tiles per warp (mma_round): acc[t * NB + nb]; mma_rows_by_columns is the one-tile form.
template <int UNROLL, int NB, bool COLS_DEP, int ROUNDS, int RT, bool SHARED = false>
__device__ __forceinline__ void mma_tiles_by_columns(float (&acc)[RT * NB][4], const ARows (&tiles)[RT],
                                                     const uint4* const (&cols)[NB], int c_begin, int c_end, int q,
                                                     bool& waited, AShare* share = nullptr) {
    float part[RT * NB][4];                                          // scaled formats: a scale block's mma sums
    #pragma unroll
    for (int n = 0; n < RT * NB; ++n) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        part[n][0] = part[n][1] = part[n][2] = part[n][3] = 0.0f;
    }
    int c0 = c_begin;
    if (ROUNDS != MASKED_ROUNDS) {
        for (; c0 + MMA_KB * UNROLL <= c_end; c0 += MMA_KB * UNROLL)
            mma_round<UNROLL, NB, COLS_DEP, false, RT, SHARED>(acc, part, tiles, cols, c0, c_end, q, waited, share);
        if (ROUNDS == WHOLE_ROUNDS && c0 < c_end)
            mma_round<UNROLL, NB, COLS_DEP, true, RT, SHARED>(acc, part, tiles, cols, c0, c_end, q, waited, share);
    } else {
        for (; c0 < c_end; c0 += MMA_KB * UNROLL)
            mma_round<UNROLL, NB, COLS_DEP, true, RT, SHARED>(acc, part, tiles, cols, c0, c_end, q, waited, share);
    }
}
template <int UNROLL, int NB, bool COLS_DEP, int ROUNDS = WHOLE_ROUNDS, bool SHARED = false>
__device__ __forceinline__ void mma_rows_by_columns(float (&acc)[NB][4], const a_chunk_t* rows_lo,
                                                    const a_chunk_t* rows_hi, const mma_scale_t* scale_lo,
                                                    const mma_scale_t* scale_hi, const uint4* const (&cols)[NB],
                                                    int c_begin, int c_end, int q, bool& waited,
                                                    AShare* share = nullptr) {
    const ARows tiles[1] = {{rows_lo, rows_hi, scale_lo, scale_hi}};
    mma_tiles_by_columns<UNROLL, NB, COLS_DEP, ROUNDS, 1, SHARED>(acc, tiles, cols, c_begin, c_end, q, waited, share);
}
"""
