"""CUDA C of the tensor-core pair (kernels/batched/mma.py): gate_up, and the down as balanced runs or grouped + sum.

``FAMILY_DEFINES`` goes before the lists (their tile table's TILE_PAIRS); ``CODE`` after the format's loader and the
tensor-core core (kernels/batched/mma_core.py).
"""

FAMILY_DEFINES = r"""
#define GB_NBLK 1            // 8-pair blocks per gate_up pass (2: measured slower at every T, notes/PROTOTYPES.md)
#define DB_NBLK 1            // ... per down pass
#define PAIR_TILES 1         // the lists with the tile table: gate_up and the downs run one block row per tile
#define DOWN_WAITS_LATE 1    // the downs' first w2 loads go before the PDL wait (they stream during gate_up's tail)
// HOT_NBLK > GB_NBLK: a tile holds up to 8 * HOT_NBLK pairs, and a tile with more than one GB_NBLK pass of pairs
// runs in ONE pass of HOT_NBLK 8-pair blocks (the A fragments loaded and widened once for all of them) with fewer k
// blocks in flight (the B fragments' registers stay those of the normal pass); the grouped down likewise with DB_NBLK,
// or with DB_HOT_UNROLL k blocks in flight where that knob is set (bf16: the normal pass's DB_UNROLL); GB_HOT_UNROLL
// likewise for the gate_up (bf16 single chain: the normal pass's GB_UNROLL).
// A work knob: each column's mma chain is the same, so the gate_up's and the grouped down's outputs are bitwise the
// same (the balanced tensor-core down's runs follow the tile table: its sums may change order).
#define HOT_GB (HOT_NBLK > GB_NBLK)
#define HOT_DB (HOT_NBLK > DB_NBLK)
#define TILE_PAIRS (8 * (HOT_GB ? HOT_NBLK : GB_NBLK))  // pairs per tile of the tile table: one gate_up pass
#define HOT_UNROLL(unroll, nblk) ((unroll) * (nblk) / HOT_NBLK > 0 ? (unroll) * (nblk) / HOT_NBLK : 1)
#define DB_HOT_ROUNDS (DB_HOT_UNROLL > 0 ? DB_HOT_UNROLL : HOT_UNROLL(DB_UNROLL, DB_NBLK))  // a hot down pass's
static_assert(DB_HOT_UNROLL >= 0 && DB_HOT_UNROLL <= 8 && GB_HOT_UNROLL >= 0 && GB_HOT_UNROLL <= 8,
              "DB_HOT_UNROLL / GB_HOT_UNROLL are 0..8 (0: the halved rounds)");
"""

CODE = r"""
// ==== the tensor-core pair (kernels/batched/mma_cuda.py) ====
// Knobs (#defines set by kernels.compile): GB_* gate/up, DB_* down. *_WARPS warps per block, *_UNROLL k blocks
// (32-wide, 64 with FP8_LOAD16) of loads in flight per lane, *_MAX_REGS register cap (0: __launch_bounds__ only);
// GB_KSPLIT S: each dot's k chain in S fixed ranges (k_range, a function of H and S alone), each its own mma chain
// from 0, the partials added in range order (__fadd_rn) -- GB_RANGE_FLUSH (derived) walks them in one loop;
// GB_SHARE 2 / 4: a hot expert's tiles in groups whose warps share each round's widened A fragments through shared
// memory (share_group; the same bits), DB_SHARE likewise in the grouped down; HOT_NBLK, GB_HOT_UNROLL,
// DB_HOT_UNROLL: a hot expert's tiles in one pass;
// DB_GROUPED 1: the down as a grouped GEMM over the tile table writing each pair's weighted FP32 row, then
// moe_sum_slots sums a token's K rows in slot order (the reference's order) and rounds once; 0: moe_down_mma's
// balanced runs; DB_ROW_TILES 2: the grouped down's warps take two 16-row tiles sharing each B fragment;
// DB_WHOLE_RANGES (derived): the bf16 grouped down compiles whole rounds only; PDL 1: programmatic dependent launch.
static_assert(GB_WARPS >= 1 && GB_WARPS <= 32 && DB_WARPS >= 1 && DB_WARPS <= 32, "WARPS must be 1..32");
static_assert(GB_UNROLL >= 1 && DB_UNROLL >= 1, "UNROLL must be >= 1");
static_assert(PDL == 0 || PDL == 1, "PDL must be 0 or 1");
static_assert(HOT_NBLK >= 0 && HOT_NBLK <= 4, "HOT_NBLK is 0..4");
static_assert(DB_GROUPED == 0 || DB_GROUPED == 1, "DB_GROUPED is 0 or 1");
static_assert(DB_ROW_TILES == 1 || (DB_ROW_TILES == 2 && DB_GROUPED == 1),
              "DB_ROW_TILES is 1 or 2 (2 needs DB_GROUPED 1)");
static_assert(GB_KSPLIT >= 1 && GB_KSPLIT <= 8, "GB_KSPLIT is 1..8");
static_assert(GB_SHARE >= 0 && GB_SHARE <= 4 && GB_SHARE != 3 &&
              (GB_SHARE <= 1 || ((GB_KSPLIT == 1 || GB_RANGE_FLUSH == 1) && GB_WARPS % GB_SHARE == 0)),
              "GB_SHARE is 0, 1, 2 or 4 (2 / 4 need one k loop -- GB_KSPLIT 1 or GB_RANGE_FLUSH 1 -- and divide "
              "GB_WARPS)");
#define GB_HOT_ROUNDS (GB_HOT_UNROLL > 0 ? GB_HOT_UNROLL : HOT_UNROLL(GB_UNROLL, GB_NBLK))
#define GB_SHARE_UNROLL (HOT_GB ? GB_HOT_ROUNDS : GB_UNROLL)
#define DB_SHARE_UNROLL (HOT_DB ? DB_HOT_ROUNDS : DB_UNROLL)
static_assert(GB_SHARE <= 1 || GB_WARPS / 2 * 2 * SHARE_ROUND(GB_SHARE_UNROLL, 1) * 16 <= 48 * 1024,
              "GB_SHARE: the groups' A buffers exceed 48 KB of static shared memory (fewer GB_WARPS or GB_UNROLL)");
static_assert(DB_SHARE >= 0 && DB_SHARE <= 4 && DB_SHARE != 3 &&
              (DB_SHARE <= 1 || (DB_GROUPED == 1 && DB_WARPS % DB_SHARE == 0 &&
                                 8 * (HOT_NBLK > DB_NBLK ? HOT_NBLK : DB_NBLK) >= TILE_PAIRS)),
              "DB_SHARE is 0, 1, 2 or 4 (2 / 4 need DB_GROUPED 1, divide DB_WARPS and a tile in one down pass)");
static_assert(DB_SHARE <= 1 || DB_WARPS / 2 * 2 * SHARE_ROUND(DB_SHARE_UNROLL, DB_ROW_TILES) * 16 <= 48 * 1024,
              "DB_SHARE: the groups' A buffers exceed 48 KB of static shared memory (fewer DB_WARPS or DB_UNROLL)");
// whole unmasked rounds where they paid (results/sweep-2026-12-02-whole-rounds-*.json): always on a format that asks
// for them (fp8), the single-chain gate_up, and the bf16 grouped down where its range is whole rounds
#define GATE_UP_ROUNDS (FORMAT_WHOLE_ROUNDS || GB_KSPLIT == 1 ? WHOLE_ROUNDS : MASKED_ROUNDS)
#define DOWN_GROUPED_ROUNDS (FORMAT_WHOLE_ROUNDS ? WHOLE_ROUNDS : DB_WHOLE_RANGES ? ONLY_WHOLE_ROUNDS : MASKED_ROUNDS)

// GB_RANGE_FLUSH (GB_KSPLIT > 1, every range a whole number of rounds -- the host checks): the split-chain
// gate_up's sums in one loop over H. Each range's chain starts from zero and is added to the total at the range's end
// (range 0's becomes it, the next ones through __fadd_rn in range order), and each empty range past H adds +0.0f --
// the same operations on the same values as one mma_rows_by_columns call per range, without a loop per range
// (whole rounds unmasked, a masked last round only at the end of H): 2-4 % faster on the H200 (bf16). A scaled format's
// partial lives across rounds as in one range's loop; a range ends on a scale block's end (the host checks it),
// where mma_round has flushed it into the range's chain.
// SHARED (GB_SHARE): every round's A fragments come through the warp's group (mma_round); the chains are unchanged.
template <int NB, int UNROLL, bool SHARED = false>
__device__ __forceinline__ void split_chain_one_loop(float (&total)[NB][4], const ARows& rows,
                                                     const uint4* const (&cols)[NB], int chunks, int q, bool& waited,
                                                     AShare* share = nullptr) {
    constexpr int ROUND = MMA_KB * UNROLL;
    int zero, size;
    k_range(chunks, 0, zero, size);                                  // range 0: chunks 0 .. size - 1
    float part[NB][4], scale_part[NB][4];                            // scaled formats: the scale block's mma sums
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int v = 0; v < 4; ++v) part[nb][v] = scale_part[nb][v] = total[nb][v] = 0.0f;
    const ARows tiles[1] = {rows};
    int flushed = 0;
    auto flush = [&]() {                                             // warp-uniform: the range's end
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int v = 0; v < 4; ++v) {
                total[nb][v] = flushed == 0 ? part[nb][v] : __fadd_rn(total[nb][v], part[nb][v]);
                part[nb][v] = 0.0f;
            }
        ++flushed;
    };
    int c0 = 0;
    for (; c0 + ROUND <= chunks; c0 += ROUND) {
        mma_round<UNROLL, NB, false, false, 1, SHARED>(part, scale_part, tiles, cols, c0, chunks, q, waited, share);
        if ((c0 + ROUND) % size == 0 || c0 + ROUND == chunks) flush();
    }
    if (c0 < chunks) {                                               // the last range's partial last round
        mma_round<UNROLL, NB, false, true, 1, SHARED>(part, scale_part, tiles, cols, c0, chunks, q, waited, share);
        flush();
    }
    for (; flushed < GB_KSPLIT; ++flushed)                           // empty ranges: + 0.0f each
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int v = 0; v < 4; ++v) total[nb][v] = __fadd_rn(total[nb][v], 0.0f);
}

// A tensor-core gate_up block's work unit, read in ONE round trip after the PDL wait: tile a of the tile table (its
// pairs: up to TILE_PAIRS, one pass).
// With GB_SHARE, run: the tile's place in its expert's run of tiles (tile_run).
struct GateUpItem { int expert, count; const int* pairs; bool unused; int run; };
__device__ __forceinline__ GateUpItem read_gate_up_item(const int* lists, int slots, int pairs, int a) {
    const int used = ld_dep(lists + 3);
    const int expert = ld_dep(TILE_ARRAY(0) + a), first = ld_dep(TILE_ARRAY(1) + a), count = ld_dep(TILE_ARRAY(2) + a);
    const int run = GB_SHARE > 1 ? ld_dep(TILE_ARRAY(3) + a) : 0;
    return {expert, count, sorted_pairs(lists, slots) + first, a >= used || (expert | first | count) < 0, run};
}

// A gate_up warp's passes over `count` pairs (pairs[0 .. count - 1]) of expert rows `rows`: NB 8-pair blocks per
// pass, UNROLL k blocks of loads in flight per lane; lane (g, q) writes the intermediate of neuron i0 + g.
// SHARED (GB_SHARE): one pass (count <= 8 NB) whose A fragments the warp's group shares (mma_round).
template <int NB, int UNROLL, bool SHARED = false>
__device__ __forceinline__ void gate_up_passes(const ARows& rows, const bf16_t* __restrict__ x, const int* pairs,
                                               int count, bf16_t* __restrict__ intermediate, int hidden, int inter,
                                               int top_k, int i0, int g, int q, float global13,
                                               const bf16_t* b13_row, AShare* share = nullptr) {
    const int chunks = hidden / 8;                                   // chunks of 8 values (H % 8 == 0)
    for (int tile = 0; tile < count; tile += 8 * NB) {
        const int n = min(8 * NB, count - tile);
        const uint4* x_row[NB];                                      // B column g of each 8-pair block
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const int p = __ldg(pairs + tile + min(nb * 8 + g, n - 1));   // past n: pair n-1 (ignored)
            x_row[nb] = reinterpret_cast<const uint4*>(x + (size_t)(p / top_k) * hidden);   // int: no division call
        }
        float acc[NB][4];
        bool unused = true;
#if GB_KSPLIT == 1
        mma_rows_by_columns<UNROLL, NB, false, GATE_UP_ROUNDS, SHARED>(acc, rows.lo, rows.hi, rows.scale_lo,
                                                                       rows.scale_hi, x_row, 0, chunks, q, unused,
                                                                       share);
#elif GB_RANGE_FLUSH
        split_chain_one_loop<NB, UNROLL, SHARED>(acc, rows, x_row, chunks, q, unused, share);
#else
        int k_begin, k_end;
        k_range(chunks, 0, k_begin, k_end);
        mma_rows_by_columns<UNROLL, NB, false, GATE_UP_ROUNDS>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi,
                                                               x_row, k_begin, k_end, q, unused);
        for (int r = 1; r < GB_KSPLIT; ++r) {                        // the next ranges, added in range order
            float part[NB][4];
            k_range(chunks, r, k_begin, k_end);
            mma_rows_by_columns<UNROLL, NB, false, GATE_UP_ROUNDS>(part, rows.lo, rows.hi, rows.scale_lo,
                                                                   rows.scale_hi, x_row, k_begin, k_end, q, unused);
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb)
                #pragma unroll
                for (int v = 0; v < 4; ++v) acc[nb][v] = __fadd_rn(acc[nb][v], part[nb][v]);
        }
#endif
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pp = nb * 8 + 2 * q + h;
                if (pp < n && i0 + g < inter) {
                    const long long p = __ldg(pairs + tile + pp);
                    // (the format's global scale, the layer's biases)
                    const float gate = WITH_BIAS(WITH_GLOBAL(acc[nb][h], global13), b13_row, i0 + g);
                    const float up = WITH_BIAS(WITH_GLOBAL(acc[nb][2 + h], global13), b13_row, inter + i0 + g);
                    intermediate[p * inter + i0 + g] = intermediate_value(expert_activation(gate, up));  // one rounding
                }
            }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_mma: block b owns work unit a, a tile of one slot's pairs (the tile table); its warp w owns neurons
//   i0 .. i0+7,
//   i0 = ((b mod per_slot) * GB_WARPS + w) * 8: A rows 0..7 = gate rows i0+g, rows 8..15 = up rows i0+g, so
//   lane (g, q) ends with gate AND up of neuron i0+g for pairs 2q, 2q+1 of each 8-pair block -- the activation
//   and the one bf16 rounding happen in the lane, no shuffle. B column g = x[token of pair g] (L1 hits).
//   GB_NBLK blocks of 8 pairs per pass (A shared), GB_UNROLL k blocks of loads in flight per lane; with HOT_GB a
//   tile of more than 8 * GB_NBLK pairs (a hot expert's) in one pass of HOT_NBLK blocks.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_mma(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const mma_scale_t* __restrict__ s13,      // scaled formats: the loader's scale rows
    const int* __restrict__ lists,            // from moe_expert_lists
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int slots, int n_pairs,
    const float* __restrict__ g13,            // global-scaled formats: a float32 scale per expert (GLOBAL_OF)
    const bf16_t* __restrict__ b13)           // EXPERT_BIAS: the gate and up biases [E, 2I] (else never read)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int per_slot = (inter + GB_WARPS * 8 - 1) / (GB_WARPS * 8);
    const int a = blockIdx.x / per_slot;
    pdl_wait();  // the lists (and x) come from the kernels before: read only after the wait, through ld_dep
    pdl_release();
    const GateUpItem item = read_gate_up_item(lists, slots, n_pairs, a);
    if (item.unused) return;                                         // whole block leaves together
#if GB_SHARE > 1
    __shared__ uint4 a_share[GB_WARPS / 2][2 * SHARE_ROUND(GB_SHARE_UNROLL, 1)];   // a region per group of warps
    int members, place;
    share_group(item.run, GB_SHARE, members, place);
    if (members > 1 && item.expert < experts) {                      // block-uniform: a group of a hot expert's tiles
        // (share_seat: the warp's neuron group and tile). A warp past I computes the last row and writes nothing,
        // so that every warp meets every barrier.
        const ShareSeat seat = share_seat(blockIdx.x - a * per_slot, members, place, GB_WARPS);
        const int i0 = seat.first * 8;
        const GateUpItem mine = read_gate_up_item(lists, slots, n_pairs, a - place + seat.member);   // same expert
        const ARows rows = w13_rows(w13, s13, item.expert, min(i0 + g, inter - 1), hidden, inter);
        AShare share{a_share[seat.set], seat.member, members, 0};
        gate_up_passes<HOT_GB ? HOT_NBLK : GB_NBLK, GB_SHARE_UNROLL, true>(
            rows, x, mine.pairs, mine.count, intermediate, hidden, inter, top_k, i0, g, q,
            GLOBAL_OF(g13, item.expert), b13 + (size_t)item.expert * 2 * inter, &share);
        return;
    }
#endif
    const int i0 = ((blockIdx.x - a * per_slot) * GB_WARPS + (threadIdx.x >> 5)) * 8;
    if (i0 >= inter) return;                                         // whole warp leaves together
    const int e = item.expert;
    const int count = item.count;
    const int* pairs = item.pairs;
    if (e >= experts) {                                              // bad ids: NaN, no weight read
        for (int j = 0; j < count; ++j) {
            const long long p = __ldg(pairs + j);
            if (lane < 8 && i0 + lane < inter) intermediate[p * inter + i0 + lane] = BF16_NAN;
        }
        return;
    }
    const ARows rows = w13_rows(w13, s13, e, min(i0 + g, inter - 1), hidden, inter);   // past the end: the last row
#if HOT_GB
    if (count > 8 * GB_NBLK) {                                       // warp-uniform: a hot expert's tile
        gate_up_passes<HOT_NBLK, GB_HOT_ROUNDS>(rows, x, pairs, count, intermediate, hidden, inter, top_k, i0, g,
                                                q, GLOBAL_OF(g13, e), b13 + (size_t)e * 2 * inter);
        return;
    }
#endif
    gate_up_passes<GB_NBLK, GB_UNROLL>(rows, x, pairs, count, intermediate, hidden, inter, top_k, i0, g, q,
                                       GLOBAL_OF(g13, e), b13 + (size_t)e * 2 * inter);
}

// The tensor-core down's view of the routing lists: the slot arrays, the sorted pairs and the routing weights.
struct DownLists {
    const int* expert; const int* offset; const int* count; const int* pairs; const float* weight;  // weight[p]
    int good;                                                        // slots with a real expert (the first ones)
};

// A run of one expert's pairs (a list slot's, or a tile's) as a share of a warp's work: A = w2[e, h0 .. h0+15,
// chunks c_begin .. c_end-1], B column g = the intermediate row of pair g of each 8-pair block of the pairs
// pairs[0 .. count-1]; lane (g, q) ends with columns h0+g
// and h0+g+8 of pairs 2q, 2q+1 and adds them times their routing weights into the warp's partial `mine`
// [T][16]: all at once when the 8-pair block's tokens are distinct, else ONE pair at a time (__syncwarp
// between pairs), so a token routed twice to one expert cannot race; either way each element gets the same
// adds in the same order.
__device__ __forceinline__ void down_mma_pairs(const DownLists& m, int e, const int* pairs, int count, int c_begin,
                                               int c_end, const bf16_t* __restrict__ intermediate,
                                               const weight_t* __restrict__ w2, const mma_scale_t* __restrict__ s2,
                                               const float* __restrict__ g2, float* mine, int hidden, int inter,
                                               int top_k, int h_lo, int h_hi, int g, int q, bool& waited) {
    const ARows rows = w2_rows(w2, s2, e, h_lo, h_hi, hidden, inter);
    for (int tile = 0; tile < count; tile += 8 * DB_NBLK) {
        const int n = min(8 * DB_NBLK, count - tile);
        // lane (g, q) holds column g of each 8-pair block: its pair, routing weight and intermediate row
        // (loaded before the k loop, so the weights' latency hides behind it)
        const uint4* inter_row[DB_NBLK];
        int col_pair[DB_NBLK];
        float col_weight[DB_NBLK];
        #pragma unroll
        for (int nb = 0; nb < DB_NBLK; ++nb) {
            const int p = __ldg(pairs + tile + min(nb * 8 + g, n - 1));   // past n: pair n-1 (ignored)
            col_pair[nb] = p;
            col_weight[nb] = __ldg(m.weight + p);
            inter_row[nb] = reinterpret_cast<const uint4*>(intermediate + (long long)p * inter);
        }
        float acc[DB_NBLK][4];
        mma_rows_by_columns<DB_UNROLL, DB_NBLK, true>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi, inter_row,
                                                      c_begin, c_end, q, waited);
        const float global2 = GLOBAL_OF(g2, e);                      // (global-scaled formats: the expert's scale)
        #pragma unroll
        for (int nb = 0; nb < DB_NBLK; ++nb)
            #pragma unroll
            for (int v = 0; v < 4; ++v) acc[nb][v] = WITH_GLOBAL(acc[nb][v], global2);
        #pragma unroll
        for (int nb = 0; nb < DB_NBLK; ++nb) {
            // lane (g, q) holds columns h0+g, h0+g+8 of pairs 2q, 2q+1 of the block: fetch their ids / weights
            int pair_of[2];
            float weight_of[2];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                pair_of[h] = __shfl_sync(FULL_MASK, col_pair[nb], 4 * (2 * q + h));
                weight_of[h] = __shfl_sync(FULL_MASK, col_weight[nb], 4 * (2 * q + h));
            }
            // the block's live pairs all of distinct tokens (always, unless a token lists one expert twice):
            // every lane adds its two pairs at once -- distinct partial rows, one add per element, the
            // same sums as the pair-by-pair order below
            const int key = nb * 8 + g < n ? col_pair[nb] / top_k : -1 - g;
            const bool repeated = __any_sync(FULL_MASK, __popc(__match_any_sync(FULL_MASK, key)) > 4);
            if (!repeated) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (nb * 8 + 2 * q + h < n) {
                        float* row = mine + (pair_of[h] / top_k) * 16;
                        row[g] = __fadd_rn(row[g], __fmul_rn(weight_of[h], acc[nb][h]));
                        row[g + 8] = __fadd_rn(row[g + 8], __fmul_rn(weight_of[h], acc[nb][2 + h]));
                    }
                }
            } else {
                #pragma unroll
                for (int pp = 0; pp < 8; ++pp) {                     // one pair at a time: a token twice
                    if (nb * 8 + pp < n && q == pp / 2) {            // the 8 lanes holding pair pp
                        const int h = pp & 1;
                        float* row = mine + (pair_of[h] / top_k) * 16;
                        row[g] = __fadd_rn(row[g], __fmul_rn(weight_of[h], acc[nb][h]));
                        row[g + 8] = __fadd_rn(row[g + 8], __fmul_rn(weight_of[h], acc[nb][2 + h]));
                    }
                    __syncwarp();
                }
            }
            __syncwarp();                                            // before the next block's adds
        }
    }
}

#if !DB_GROUPED  // the balanced down, or the grouped down and the slot sum
// ------------------------------------------------------------------------------------------------
// moe_down_mma: block b owns hidden columns h0 .. h0+15 (h0 = 16 b) for ALL tokens. The (tile, k block) items of
//   the tile table's good tiles, tile-major, are cut into DB_WARPS contiguous runs of equal length (+-1), warp w the
//   w-th -- every warp streams the same bytes, crossing tile boundaries, and an expert weighs its tiles (a fixed
//   schedule). Per run piece (down_mma_pairs): A = w2[e, h0 .. h0+15, k range] x B = the pairs' intermediate rows,
//   FP32 in the tensor core, adds into the warp's shared partial[w][t][16]. After __syncthreads the warps' partials
//   are summed in warp order: deterministic, no atomics.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DB_BOUNDS moe_down_mma(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const mma_scale_t* __restrict__ s2,       // scaled formats: the loader's scale rows
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k, int slots,
    const float* __restrict__ g2,             // global-scaled formats: a float32 scale per expert (GLOBAL_OF)
    const bf16_t* __restrict__ b2)            // (a layer with biases runs the grouped down: never read)
{
    static_assert(!EXPERT_BIAS, "the balanced down splits a pair's dot between warps: biases need DB_GROUPED 1");
    (void)b2;
#ifdef WD_HOST_EMULATION
    float* partial = wdb_dynamic_shared;                             // the CPU emulation's buffer
#else
    extern __shared__ float partial[];                               // [DB_WARPS][T][16]
#endif
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * 16;
    float* mine = partial + (size_t)warp * tokens * 16;
    const DownLists m{list_expert(lists), list_offset(lists, slots), list_count(lists, slots),
                      sorted_pairs(lists, slots), topk_weights, __ldg(lists) - (__ldg(lists + 2) > 0)};
    down_prologue(mine, tokens * 16, lane);

    const int chunks = inter / 8;                                    // chunks of 8 values (I % 8 == 0)
    const int h_lo = min(h0 + g, hidden - 1), h_hi = min(h0 + g + 8, hidden - 1);   // past the end: last row
    bool waited = false;
    const int kblocks = (chunks + MMA_KB - 1) / MMA_KB;              // k blocks (32- or 64-wide)
    const int pairs = tokens * top_k;                                // (TILE_ARRAY's names)
    const int units = __ldg(lists + 3) - (__ldg(lists + 2) + TILE_PAIRS - 1) / TILE_PAIRS;   // the good tiles
    const long long items = (long long)units * kblocks;              // (tile, k block), tile-major
    int item = (int)(items * warp / DB_WARPS);
    const int item_end = (int)(items * (warp + 1) / DB_WARPS);
    while (item < item_end) {                                        // warp-uniform
        const int a = item / kblocks;
        const int kb = item - a * kblocks;
        const int kb_end = min(kblocks, kb + (item_end - item));
        down_mma_pairs(m, __ldg(TILE_ARRAY(0) + a), m.pairs + __ldg(TILE_ARRAY(1) + a), __ldg(TILE_ARRAY(2) + a),
                       MMA_KB * kb, min(MMA_KB * kb_end, chunks), intermediate, w2, s2, g2, mine, hidden, inter, top_k,
                       h_lo, h_hi, g, q, waited);
        item += kb_end - kb;
    }
    down_epilogue_wait();
    __syncthreads();

    write_block_outputs<16>(partial, topk_ids, out, out_f32, tokens, hidden, experts, top_k, h0);
}
#else
// The grouped down warp's passes over a tile's `count` pairs (tile_pairs[0 .. count - 1]): NB 8-pair blocks per pass,
// UNROLL k blocks of loads in flight per lane; lane (g, q) writes rows h0+16t+g, h0+16t+g+8 of its pairs' FP32 rows
// for each of the RT row tiles t it is given.
// SHARED (DB_SHARE): one pass (count <= 8 NB) whose A fragments the warp's group shares (mma_round).
template <int NB, int UNROLL, int RT, bool SHARED = false>
__device__ __forceinline__ void down_grouped_passes(const ARows (&tiles)[RT], const int* tile_pairs,
                                                    int count, const bf16_t* __restrict__ intermediate,
                                                    const float* __restrict__ topk_weights,
                                                    float* __restrict__ pair_out, int hidden, int inter, int h0, int g,
                                                    int q, bool& waited, float global2, const bf16_t* b2_row,
                                                    AShare* share = nullptr) {
    const int chunks = inter / 8;                                    // chunks of 8 values (I % 8 == 0)
    for (int sub = 0; sub < count; sub += 8 * NB) {
        const int n = min(8 * NB, count - sub);
        const uint4* inter_row[NB];
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const int p = __ldg(tile_pairs + sub + min(nb * 8 + g, n - 1));   // past n: pair n-1 (ignored)
            inter_row[nb] = reinterpret_cast<const uint4*>(intermediate + (long long)p * inter);
        }
        float acc[RT * NB][4];
        mma_tiles_by_columns<UNROLL, NB, true, DOWN_GROUPED_ROUNDS, RT, SHARED>(acc, tiles, inter_row, 0, chunks, q,
                                                                               waited, share);
        #pragma unroll
        for (int nb = 0; nb < NB; ++nb)
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int pp = nb * 8 + 2 * q + h;
                if (pp < n) {
                    const long long p = __ldg(tile_pairs + sub + pp);
                    const float weight = __ldg(topk_weights + p);
                    float* row = pair_out + p * hidden;
                    #pragma unroll
                    for (int t = 0; t < RT; ++t) {
                        const int h_t = h0 + 16 * t + g;
                        const float lo = WITH_GLOBAL(acc[t * NB + nb][h], global2);   // (global scale, biases)
                        const float hi = WITH_GLOBAL(acc[t * NB + nb][2 + h], global2);
                        if (h_t < hidden) row[h_t] = __fmul_rn(weight, WITH_BIAS(lo, b2_row, h_t));
                        if (h_t + 8 < hidden) row[h_t + 8] = __fmul_rn(weight, WITH_BIAS(hi, b2_row, h_t + 8));
                    }
                }
            }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_down_grouped: the down as one grouped GEMM over the tile table, like the tensor-core gate_up.
//   Block b owns tile a = b / per_tile (tiles past lists[3] and the bad-id slot's tiles exit) and hidden rows
//   h0 .. h0 + 16*R*DB_WARPS - 1 (R = DB_ROW_TILES); warp w the 16 R rows from h0 + 16Rw, R tiles of 16 sharing each
//   B fragment: A = w2[e, those rows, all of I], B column g =
//   the intermediate row of pair g of each 8-pair block of the tile (DB_NBLK blocks per pass; HOT_NBLK for a tile of
//   more than 8 * DB_NBLK pairs, HOT_DB). Lane (g, q) ends with rows h0+g, h0+g+8 of pairs 2q, 2q+1 and writes
//   pair_out[p, h] = topk_weight[p] * dot (FP32, once per element: every good pair's row is written by exactly one
//   warp per 16 rows). No shared memory, no atomics;
//   the expert's later tiles re-read its rows while the first tile's blocks run (L2 hits), as in gate_up.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DB_BOUNDS moe_down_grouped(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const mma_scale_t* __restrict__ s2,       // scaled formats: the loader's scale rows
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists (the tile table)
    float* __restrict__ pair_out,             // [T*K, H] FP32: each pair's weighted expert output
    int hidden, int inter, int experts, int top_k, int slots, int pairs,
    const float* __restrict__ g2,             // global-scaled formats: a float32 scale per expert (GLOBAL_OF)
    const bf16_t* __restrict__ b2)            // EXPERT_BIAS: the down biases [E, H] (else never read)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    constexpr int WARP_ROWS = 16 * DB_ROW_TILES;
    const int per_tile = (hidden + DB_WARPS * WARP_ROWS - 1) / (DB_WARPS * WARP_ROWS);
    const int a = blockIdx.x / per_tile;
    // the tile table comes from the list kernel, two kernels back: complete before this grid started
    const int used = __ldg(lists + 3);
    const int e = __ldg(TILE_ARRAY(0) + a), first = __ldg(TILE_ARRAY(1) + a), count = __ldg(TILE_ARRAY(2) + a);
    const int h0 = ((blockIdx.x - a * per_tile) * DB_WARPS + (threadIdx.x >> 5)) * WARP_ROWS;
    const bool good = a < used && (e | first | count) >= 0 && e < experts;            // block-uniform
#if DB_SHARE > 1
    __shared__ uint4 a_share[DB_WARPS / 2][2 * SHARE_ROUND(DB_SHARE_UNROLL, DB_ROW_TILES)];   // a region per group
    int members = 1, place = 0;
    if (good) share_group(__ldg(TILE_ARRAY(3) + a), DB_SHARE, members, place);
    if (members > 1) {                                               // block-uniform: a group of a hot expert's tiles
        // as gate_up's groups (share_seat: the warp's row tile and tile); a warp past H computes the last rows and
        // writes nothing, so that every warp meets every barrier
        const ShareSeat seat = share_seat(blockIdx.x - a * per_tile, members, place, DB_WARPS);
        const int rows0 = seat.first * WARP_ROWS;
        const int mine = a - place + seat.member;                    // the same expert's tile
        const int* tile_pairs = sorted_pairs(lists, slots) + __ldg(TILE_ARRAY(1) + mine);
        const int mine_count = __ldg(TILE_ARRAY(2) + mine);
        bool waited = false;
        ARows tiles[DB_ROW_TILES];
        #pragma unroll
        for (int t = 0; t < DB_ROW_TILES; ++t)
            tiles[t] = w2_rows(w2, s2, e, min(rows0 + 16 * t + g, hidden - 1),
                               min(rows0 + 16 * t + g + 8, hidden - 1), hidden, inter);
        AShare share{a_share[seat.set], seat.member, members, 0};
        down_grouped_passes<HOT_DB ? HOT_NBLK : DB_NBLK, DB_SHARE_UNROLL, DB_ROW_TILES, true>(
            tiles, tile_pairs, mine_count, intermediate, topk_weights, pair_out, hidden, inter, rows0, g, q, waited,
            GLOBAL_OF(g2, e), b2 + (size_t)e * hidden, &share);
        down_epilogue_wait();
        return;
    }
#endif
    bool waited = false;
    if (good && h0 < hidden) {                                       // warp-uniform
        const int* tile_pairs = sorted_pairs(lists, slots) + first;
        ARows tiles[DB_ROW_TILES];
        #pragma unroll
        for (int t = 0; t < DB_ROW_TILES; ++t)                       // past the end: the last row
            tiles[t] = w2_rows(w2, s2, e, min(h0 + 16 * t + g, hidden - 1), min(h0 + 16 * t + g + 8, hidden - 1),
                               hidden, inter);
#if HOT_DB
        if (count > 8 * DB_NBLK) {                                   // warp-uniform: a hot expert's tile
            down_grouped_passes<HOT_NBLK, DB_HOT_ROUNDS, DB_ROW_TILES>(tiles, tile_pairs, count, intermediate,
                                                                       topk_weights, pair_out, hidden, inter, h0, g,
                                                                       q, waited, GLOBAL_OF(g2, e),
                                                                       b2 + (size_t)e * hidden);
        } else
#endif
            down_grouped_passes<DB_NBLK, DB_UNROLL, DB_ROW_TILES>(tiles, tile_pairs, count, intermediate, topk_weights,
                                                                  pair_out, hidden, inter, h0, g, q, waited,
                                                                  GLOBAL_OF(g2, e), b2 + (size_t)e * hidden);
    }
    down_epilogue_wait();  // warps that never waited (no work) before the grid may end
}

// ------------------------------------------------------------------------------------------------
// moe_sum_slots: out[t, h] = sum over k = 0 .. K-1, in slot order from 0.0f, of pair_out[t*K + k, h]
//   (the reference's order and roundings: one FP32 add per slot, one final rounding to bf16); a token with any
//   expert id outside [0, E) gets NaN (its bad pairs' rows were never written). Thread j: 4 columns of one token.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256) moe_sum_slots(
    const float* __restrict__ pair_out,       // [T*K, H]
    const int* __restrict__ topk_ids,         // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int experts, int top_k)
{
    pdl_wait();     // pair_out is the down's output
    pdl_release();
    const int quads = hidden / 4;                                    // H % 8 == 0
    const long long j = (long long)blockIdx.x * 256 + threadIdx.x;
    if (j >= (long long)tokens * quads) return;
    const int t = (int)(j / quads);
    const int h = (int)(j - (long long)t * quads) * 4;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool bad = false;
    for (int k = 0; k < top_k; ++k) {
        bad |= (unsigned)ld_dep(topk_ids + t * top_k + k) >= (unsigned)experts;
        const uint4 w = ld_dep(reinterpret_cast<const uint4*>(pair_out + ((long long)t * top_k + k) * hidden + h));
        v[0] = __fadd_rn(v[0], __uint_as_float(w.x));
        v[1] = __fadd_rn(v[1], __uint_as_float(w.y));
        v[2] = __fadd_rn(v[2], __uint_as_float(w.z));
        v[3] = __fadd_rn(v[3], __uint_as_float(w.w));
    }
    const long long idx = (long long)t * hidden + h;
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
        const float r = bad ? __int_as_float(0x7fc00000) : v[c];
        if (out_f32) reinterpret_cast<float*>(out)[idx + c] = r;
        else reinterpret_cast<bf16_t*>(out)[idx + c] = f32_to_bf16(r);  // the one final rounding
    }
}
#endif  // DB_GROUPED
"""

GATE_UP, DOWN, DOWN_GROUPED, SUM_SLOTS = "moe_gate_up_mma", "moe_down_mma", "moe_down_grouped", "moe_sum_slots"
