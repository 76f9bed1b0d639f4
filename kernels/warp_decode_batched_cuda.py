"""CUDA C of batched warp decode (kernels/warp_decode_batched.py); compiled through kernels.compile.

Three kernels, knobs as ``#define`` (``LIST_*`` the routing lists, ``GB_*`` gate/up, ``DB_*`` down):

* ``moe_expert_lists``   one block: the batch's active experts (ascending id), each one's offset / count
                         into a pair list sorted by expert (stable by pair index), the active count.
* ``moe_gate_up_batched`` one warp per (active expert, GB_OUTS neurons) for ALL pairs routed to the expert.
* ``moe_down_batched``    one block per DB_OUTS hidden columns for ALL tokens; its warps split the experts.

The bf16 conventions and device helpers (``Vec``/``word``/``ldg_chunk``, ``all_loads_arrived``,
``f32_to_bf16``, ``warp_sum``) are the strict kernel's, from kernels/device_helpers.py (so the gate/up
intermediate is bitwise equal to the strict kernel's at equal load width).
"""

from __future__ import annotations

from kernels.device_helpers import FP8_HELPERS, MMA_HELPERS, PDL_HELPERS, WARP_HELPERS

CODE = WARP_HELPERS + FP8_HELPERS + PDL_HELPERS + r"""
// Batched warp decode for MoE decode: every expert's weights are read ONCE per batch (per token tile).
// bf16 travels as raw 16-bit patterns: widening is a shift / mask, narrowing is integer RNE.
// Knobs (#defines set by kernels.compile):
//   LIST_THREADS, LIST_PER   threads of the list kernel, experts per thread (E + 1 <= product)
//   GB_* gate/up, DB_* down: *_WARPS warps per block, *_OUTS outputs per warp, *_TILE pairs per pass
//   (FP32 accumulators [TILE][OUTS] in registers), *_UNROLL chunk rounds in flight per lane,
//   *_BYTES bytes per lane per load (4, 8, 16), *_MAX_REGS register cap (0: __launch_bounds__ only; the host
//   rules resolve the default -1, "auto", before compiling -- compiled as it is, it means launch bounds alone),
//   DB_EARLY_INTER 1: the down kernel issues a round's intermediate loads together with its w2 loads
//   GB_MMA / DB_MMA 1: the tensor-core kernels moe_gate_up_mma / moe_down_mma instead (16-byte loads; *_UNROLL
//   = k blocks (32-wide; 64 with FP8_LOAD16) in flight, *_NBLK = blocks of 8 pairs per pass; *_OUTS / *_TILE /
//   *_BYTES unused)
//   PDL 1: programmatic dependent launch (sm_90+): each kernel waits (griddepcontrol.wait) before it reads
//   what the kernel right before it wrote, then lets the next kernel's blocks launch; down reads the lists
//   (two kernels back) before its wait
//   DB_EARLY_W2 1 (with PDL, tensor-core down only): down's first round of w2 loads is issued BEFORE its wait (w2
//   and the lists do not depend on gate_up), so they stream while gate_up drains; 0: down waits first. (The FMA
//   down's w2 loads are invariant __ldg loads that the compiler sinks below the wait: no knob there.)
//   DB_BALANCE 1 (tensor-core down only): the warps split the (slot, k block) items evenly (below)
//   PAIR_TILES 1 (tensor-core gate_up only): the list kernel also cuts every slot's pairs into tiles of TILE_PAIRS
//   (= 8 * GB_NBLK, one gate_up pass, or 8 * HOT_NBLK) -- the tile table; gate_up then runs one block row per
//   TILE, so a hot expert's pairs spread over as many warps as it has tiles, and the balanced tensor-core down cuts
//   (tile, k block) items instead of (slot, k block): its warps' runs then weigh an expert by its pairs, not 1 each
//   HOT_NBLK > GB_NBLK (with PAIR_TILES): tiles of up to 8 * HOT_NBLK pairs; one with more than a GB_NBLK pass runs
//   in one pass of HOT_NBLK blocks (gate_up and grouped down; TILE_PAIRS below)
//   DB_GROUPED 1 (with DB_MMA, PAIR_TILES): the down as gate_up is, one block row per tile: moe_down_grouped's warp
//   owns 16 hidden rows of the tile's expert over the whole I and writes each pair's weighted FP32 row; a fourth
//   kernel, moe_sum_slots, sums a token's K rows in slot order (the reference's order) and rounds once
//   PER_PAIR 1 (with GB_MMA, DB_MMA): the grouped tensor-core path's numerics without its lists -- moe_gate_up_pair
//   runs the tensor-core gate_up on one pair per block row (its x row in every column) and moe_down_token gives a
//   block one token and 16 hidden rows, warp k the pair of slot k (the grouped down's mma chain over all of I),
//   then sums the weighted rows in slot order from 0 as moe_sum_slots does: two launches, and a token's output is
//   bitwise what the grouped path gives it, whatever else is in the batch (the batch-invariant policy's small T);
//   K <= 16 (a block of K warps)
//   W_FP8 1: the weights are fp8-block128 (kernels/formats.py): e4m3fn bytes in the bf16 layouts and a float32
//   scale per 128 x 128 block (s13: gate's block rows, then up's; s2). The FMA kernels load GB_BYTES / 2 (DB_BYTES
//   / 2) bytes of weights per chunk -- the values of a GB_BYTES activation chunk -- and multiply each widened
//   value by its block's scale (the dequantized weight, as the strict FP8 kernels); the tensor-core kernels feed
//   the values to mma.sync as bf16 (exact, times 2^-112) and scale each k block's FP32 partial by its block's
//   scale. Activations stay bf16, accumulation FP32. With W_FP8 0 the scale pointers are never read.
//   W_TILED 1 (both kernels on tensor cores; W_FP8 with FP8_LOAD16): the values are fp8-block128-t16's 16-row x
//   64-value tiles, or bf16-t16's 16-row x 32-value ones (w13_rows, a_index): a warp's k block of its 16 rows is 1 KB
//   of contiguous bytes; the same sums
//   FP8_LOAD16 1 (W_FP8, tensor-core kernels): a lane loads 16 e4m3 values of each A row per k step (16-byte
//   loads, 64-wide k blocks, H and I multiples of 16) instead of 8 (8-byte loads, 32-wide k blocks).
//   FP8_BLOCK_SUM 1 (W_FP8, tensor-core kernels): the k blocks of one 128-wide scale block accumulate into one
//   FP32 partial (in the tensor core), scaled once when the scale block (or the warp's k range) ends; 0: each
//   k block's partial is scaled on its own. Either way a function of k alone: never of T or the batch.
//   GB_KSPLIT S (tensor-core gate_up): each dot's k chain is cut into S fixed ranges (k_range: a function of H and
//   S alone, never of T), each its own mma chain from 0, the partials added in range order from range 0 (FP32,
//   __fadd_rn). moe_gate_up_mma runs the ranges one after another in one warp; moe_gate_up_pair gives each range
//   its own warp (GB_WARPS / S neuron groups per block) and adds the partials through shared memory -- the same
//   bits either way, with S times the warps at small T. S = 1 is the single chain over H.
//   GB_SHARE 2 / 4 (tensor-core gate_up, PAIR_TILES, one k loop: GB_KSPLIT 1 or GB_RANGE_FLUSH): a hot expert's
//   tiles in groups of up to GB_SHARE (share_group); a group of m tiles runs in its m block rows remapped so that
//   each block holds W / m neuron groups x the m tiles, and the m warps of one neuron group share each round's A
//   fragments: k block j of the round is loaded and widened by member j mod m alone and passed through shared
//   memory (a_share, a block barrier per round). Each warp's mma chains are the ones it runs alone: the same bits.
static_assert(LIST_THREADS >= 32 && LIST_THREADS <= 1024 && LIST_THREADS % 32 == 0, "LIST_THREADS: 32..1024, x32");
static_assert(LIST_PER >= 1 && LIST_PER <= 16, "LIST_PER must be 1..16");
static_assert(GB_WARPS >= 1 && GB_WARPS <= 32 && DB_WARPS >= 1 && DB_WARPS <= 32, "WARPS must be 1..32");
static_assert(GB_OUTS >= 1 && GB_OUTS <= 32 && DB_OUTS >= 1 && DB_OUTS <= 32, "OUTS must be 1..32");
static_assert(GB_TILE >= 1 && GB_TILE <= 32 && DB_TILE >= 1 && DB_TILE <= 32, "TILE must be 1..32");
static_assert(GB_UNROLL >= 1 && DB_UNROLL >= 1, "UNROLL must be >= 1");
static_assert(GB_BYTES == 4 || GB_BYTES == 8 || GB_BYTES == 16, "GB_BYTES must be 4, 8 or 16");
static_assert(DB_BYTES == 4 || DB_BYTES == 8 || DB_BYTES == 16, "DB_BYTES must be 4, 8 or 16");
static_assert(DB_EARLY_INTER == 0 || DB_EARLY_INTER == 1, "DB_EARLY_INTER must be 0 or 1");
static_assert((GB_MMA == 0 || GB_MMA == 1) && (DB_MMA == 0 || DB_MMA == 1), "GB_MMA / DB_MMA must be 0 or 1");
static_assert(GB_NBLK >= 1 && GB_NBLK <= 4 && DB_NBLK >= 1 && DB_NBLK <= 4, "NBLK must be 1..4");
static_assert(PDL == 0 || PDL == 1, "PDL must be 0 or 1");
static_assert(HOT_NBLK >= 0 && HOT_NBLK <= 4 && (HOT_NBLK == 0 || GB_MMA == 1), "HOT_NBLK is 0..4 (needs GB_MMA 1)");
static_assert(DB_EARLY_W2 == 0 || (DB_EARLY_W2 == 1 && DB_MMA == 1), "DB_EARLY_W2 is 0 or 1 (1 needs DB_MMA 1)");
static_assert(DB_BALANCE == 0 || (DB_BALANCE == 1 && DB_MMA == 1), "DB_BALANCE is 0 or 1 (1 needs DB_MMA 1)");
static_assert(PAIR_TILES == 0 || (PAIR_TILES == 1 && GB_MMA == 1), "PAIR_TILES is 0 or 1 (1 needs GB_MMA 1)");
static_assert(DB_GROUPED == 0 || (DB_GROUPED == 1 && DB_MMA == 1 && PAIR_TILES == 1),
              "DB_GROUPED is 0 or 1 (1 needs DB_MMA 1 and PAIR_TILES 1)");
static_assert(DB_ROW_TILES == 1 || (DB_ROW_TILES == 2 && DB_GROUPED == 1),
              "DB_ROW_TILES is 1 or 2 (2 needs DB_GROUPED 1)");
static_assert(W_FP8 == 0 || (W_FP8 == 1 && GB_BYTES >= 8 && DB_BYTES >= 8), "W_FP8 is 0 or 1 (1 needs BYTES >= 8)");
static_assert(PER_PAIR == 0 || (PER_PAIR == 1 && GB_MMA == 1 && DB_MMA == 1 && PAIR_TILES == 0 && DB_GROUPED == 0),
              "PER_PAIR is 0 or 1 (1 needs GB_MMA 1, DB_MMA 1 and no tiles: it runs without lists)");
static_assert(GB_KSPLIT >= 1 && GB_KSPLIT <= 8 && (GB_KSPLIT == 1 || GB_MMA == 1),
              "GB_KSPLIT is 1..8 (above 1 it needs GB_MMA 1)");
static_assert(PER_PAIR == 0 || GB_WARPS % GB_KSPLIT == 0, "PER_PAIR: GB_WARPS must be a multiple of GB_KSPLIT");
static_assert(GB_SHARE >= 0 && GB_SHARE <= 4 && GB_SHARE != 3 &&
              (GB_SHARE <= 1 || (GB_MMA == 1 && PAIR_TILES == 1 && (GB_KSPLIT == 1 || GB_RANGE_FLUSH == 1) &&
                                 GB_WARPS % GB_SHARE == 0)),
              "GB_SHARE is 0, 1, 2 or 4 (2 / 4 need GB_MMA 1, PAIR_TILES 1, one k loop -- GB_KSPLIT 1 or "
              "GB_RANGE_FLUSH 1 -- and divide GB_WARPS)");
static_assert((FP8_LOAD16 == 0 || FP8_LOAD16 == 1) && (FP8_BLOCK_SUM == 0 || FP8_BLOCK_SUM == 1) &&
              (W_FP8 == 1 || (FP8_LOAD16 == 0 && FP8_BLOCK_SUM == 0)),
              "FP8_LOAD16 / FP8_BLOCK_SUM are 0 or 1 (1 needs W_FP8 1)");
static_assert(W_TILED == 0 || (W_TILED == 1 && (W_FP8 == 0 || FP8_LOAD16 == 1) && GB_MMA == 1 && DB_MMA == 1),
              "W_TILED is 0 or 1 (1: fp8-block128-t16 or bf16-t16 values, read by the tensor-core kernels; FP8 with "
              "FP8_LOAD16 1)");
#if W_FP8
typedef unsigned char weight_t;                   // e4m3fn bytes
#define GB_WBYTES (GB_BYTES / 2)                  // a weight chunk holds the values of an activation chunk
#define DB_WBYTES (DB_BYTES / 2)
#else
typedef bf16_t weight_t;
#define GB_WBYTES GB_BYTES
#define DB_WBYTES DB_BYTES
#endif
// The scales of weight row `row` (in units of the matrix's rows) of expert e: w13's gate row i at (e * 2 IB +
// i / 128) * HB, its up row at (e * 2 IB + IB + i / 128) * HB; w2's row h at (e * HB + h / 128) * IB.
__device__ __forceinline__ const float* scale_row(const float* scales, long long block_row, int col_blocks) {
    return scales + block_row * col_blocks;
}
// value pair w (0 .. BYTES/4 - 1 of the activation chunk) of weight chunk wv, dequantized: bf16 widened, or
// e4m3fn widened and multiplied by its block's scale (rounded once in FP32, as the reference reads it)
template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, float scale, float& lo, float& hi) {
#if W_FP8
    e4m3x2_to_f32(word(wv, w / 2) >> (16 * (w % 2)), lo, hi);
    lo = __fmul_rn(lo, scale);
    hi = __fmul_rn(hi, scale);
#else
    (void)scale;
    lo = bf16_lo(word(wv, w));
    hi = bf16_hi(word(wv, w));
#endif
}
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
static_assert(DB_SHARE >= 0 && DB_SHARE <= 4 && DB_SHARE != 3 &&
              (DB_SHARE <= 1 || (DB_GROUPED == 1 && DB_WARPS % DB_SHARE == 0 &&
                                 8 * (HOT_NBLK > DB_NBLK ? HOT_NBLK : DB_NBLK) >= TILE_PAIRS)),
              "DB_SHARE is 0, 1, 2 or 4 (2 / 4 need DB_GROUPED 1, divide DB_WARPS and a tile in one down pass)");
#define DOWN_WAITS_LATE DB_EARLY_W2  // the tensor-core down's wait follows its first A (w2) loads

// The int32 ``lists`` buffer, S = min(E, T*K) + 1 list slots (every active expert + one for bad ids):
//   lists[0]              slots used: active experts, plus 1 when some id is out of range
//   lists[1], lists[2]    pairs with a good id, pairs with a bad id
//   list_expert[S]        expert of each slot, ascending; the bad-id slot (last used) holds E
//   list_offset[S]        first index of the slot's pairs in sorted_pairs
//   list_count[S]         number of its pairs
//   sorted_pairs[T*K]     pair ids p = t*K + k grouped by slot, ascending p inside a slot
// and, written with PAIR_TILES only (lists[3] = tiles used, else 0), the tile table: C = S + T*K / 8 entries
// each (enough for any TILE_PAIRS >= 8: a slot's ceil(count / TILE) <= count / TILE + 1), tiles in slot order
// (the bad-id slot's last), a slot's pairs cut into runs of TILE_PAIRS from its first:
//   tile_expert[C], tile_first[C] (index into sorted_pairs), tile_count[C] (1 .. TILE_PAIRS),
//   tile_run[C] = t | n << 16: the tile is its expert's t-th of n (GB_SHARE groups a hot expert's tiles by it)
#define LIST_HEADER 4
__device__ __forceinline__ const int* list_expert(const int* lists) { return lists + LIST_HEADER; }
#define SLOT_ARRAY(k) (lists + LIST_HEADER + (k) * slots)
__device__ __forceinline__ const int* list_offset(const int* lists, int slots) { return SLOT_ARRAY(1); }
__device__ __forceinline__ const int* list_count(const int* lists, int slots) { return SLOT_ARRAY(2); }
__device__ __forceinline__ const int* sorted_pairs(const int* lists, int slots) { return SLOT_ARRAY(3); }
__device__ __forceinline__ int tile_capacity(int slots, int pairs) { return slots + pairs / 8; }
#define TILE_ARRAY(k) (lists + LIST_HEADER + 3 * slots + pairs + (k) * tile_capacity(slots, pairs))
// GB_SHARE / DB_SHARE: the group of tile t of its expert's n (run = t | n << 16): the run cut into groups of `most`
// tiles from its first, the rest into groups of most / 2, ... -- members (1 = no group) and the tile's place in it.
__device__ __forceinline__ void share_group(int run, int most, int& members, int& place) {
    const int t = run & 0xFFFF, n = run >> 16;
    int m = most > 1 ? most : 1, base = 0;
    while (m > 1) {
        const int full = (n - base) / m * m;
        if (t < base + full) break;
        base += full;
        m >>= 1;
    }
    members = m;
    place = (t - base) % m;
}

// ------------------------------------------------------------------------------------------------
// moe_expert_lists: ONE block of LIST_THREADS threads; "expert" E stands for every out-of-range id. Everything
// between the PDL wait and the scatter stays in shared memory: running[E + 1], key_of[T*K], rank_of[T*K] and one
// count table [E + 1] per warp.
//   0) all threads load the ids (8 per thread in flight: one memory latency for T*K <= 8 * LIST_THREADS)
//   1) warp w ranks its own contiguous range of pairs (whole chunks of 32, in pair order; the warps at once):
//      lanes holding the same expert find each other (__match_any_sync); a pair's rank in the range = its
//      expert's pairs seen so far in the warp's table + the lanes of its group below it; the group's lowest
//      lane then bumps the table. Then thread j, for its experts, turns the warps' tables into exclusive
//      prefixes over the warps (pairs of that expert in the ranges before) and running[e] into the total.
//      Deterministic, no atomics, ceil(T*K / LIST_THREADS) match steps per warp.
//   2) thread j owns experts j*LIST_PER .. j*LIST_PER+LIST_PER-1: a scan of (pairs, active experts) over the
//      threads (shuffles inside a warp, then the warps' totals) gives each expert its slot and first position;
//      the slot arrays are written and running[e] becomes expert e's first position.
//   3) every pair p goes to sorted_pairs[first[e] + (pairs of e in the ranges before p's) + rank_of[p]]: grouped
//      by expert, ascending p inside.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ int expert_key(int id, int experts) {
    return (unsigned)id >= (unsigned)experts ? experts : id;      // every bad id -> the pseudo expert E
}

// inclusive sum over the warp's lanes (lane l: lanes 0..l), by shuffles
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int below = __shfl_sync(FULL_MASK, v, lane - d);
        if (lane >= d) v += below;
    }
    return v;
}

#if !PER_PAIR  // the per-pair path runs without lists
extern "C" __global__ void __launch_bounds__(LIST_THREADS) moe_expert_lists(
    const int* __restrict__ topk_ids,   // [T*K]
    int pairs, int experts, int slots,
    int* __restrict__ lists)
{
#ifdef WD_HOST_EMULATION
    int* running = reinterpret_cast<int*>(wdb_dynamic_shared);      // the CPU emulation's buffer
#else
    extern __shared__ int running[];                                 // [E + 1], then key_of, rank_of
#endif
    int* key_of = running + experts + 1;                             // [T*K]
    int* rank_of = key_of + pairs;                                   // [T*K]
    constexpr int WARPS = LIST_THREADS / 32;
    int* warp_counts = rank_of + pairs;                              // [WARPS][E + 1]
    __shared__ int warp_pairs[WARPS];
    __shared__ int warp_slots[WARPS];
    __shared__ int warp_tiles[WARPS];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    int* expert_of = lists + LIST_HEADER;
    int* offset_of = lists + LIST_HEADER + slots;
    int* count_of = lists + LIST_HEADER + 2 * slots;
    int* sorted = lists + LIST_HEADER + 3 * slots;
    for (int j = tid; j < (experts + 1) * WARPS; j += LIST_THREADS) warp_counts[j] = 0;
    pdl_wait();     // topk_ids may come from the kernel right before (the router); lists may still be read by
    pdl_release();  // the previous layer's down: nothing is read or written earlier

    // 0) the ids, 8 loads per thread issued before any is used
    for (int p0 = 0; p0 < pairs; p0 += 8 * LIST_THREADS) {
        int ids[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int p = p0 + j * LIST_THREADS + tid;
            ids[j] = ld_dep(topk_ids + (p < pairs ? p : 0));        // branch-free: 8 loads in flight
        }
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int p = p0 + j * LIST_THREADS + tid;
            if (p < pairs) key_of[p] = expert_key(ids[j], experts);
        }
    }
    __syncthreads();

    // 1) ranks inside each warp's range of pairs, then the warps' counts -> exclusive prefixes over the warps
    const int warp = tid >> 5;
    const int range = (pairs + 32 * WARPS - 1) / (32 * WARPS) * 32;  // pairs per warp, whole chunks of 32
    int* counts = warp_counts + warp * (experts + 1);
    for (int p0 = warp * range; p0 < min(pairs, (warp + 1) * range); p0 += 32) {   // warp-uniform
        const int p = p0 + lane;
        const int key = p < pairs ? key_of[p] : -1;
        const u32 group = __match_any_sync(FULL_MASK, key);
        const u32 below = group & ((1u << lane) - 1u);
        const int base = p < pairs ? counts[key] : 0;
        __syncwarp();                                                // every lane has read before any update
        if (p < pairs) {
            rank_of[p] = base + __popc(below);
            if (below == 0u) counts[key] = base + __popc(group);
        }
        __syncwarp();
    }
    __syncthreads();
    for (int e = tid; e <= experts; e += LIST_THREADS) {
        int total = 0;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const int here = warp_counts[w * (experts + 1) + e];
            warp_counts[w * (experts + 1) + e] = total;              // pairs of e in the ranges before w's
            total += here;
        }
        running[e] = total;
    }
    __syncthreads();

    // 2) scan over experts (thread order = expert order): inside each warp, then over the warps' totals
    const int e_first = tid * LIST_PER;
    int count[LIST_PER];
    int my_pairs = 0, my_slots = 0;
    #pragma unroll
    for (int j = 0; j < LIST_PER; ++j) {
        count[j] = e_first + j <= experts ? running[e_first + j] : 0;
        my_pairs += count[j];
        my_slots += count[j] > 0;
    }
    int my_tiles = 0;                                                // PAIR_TILES: the slots' tiles
    #pragma unroll
    for (int j = 0; j < LIST_PER; ++j) my_tiles += PAIR_TILES ? (count[j] + TILE_PAIRS - 1) / TILE_PAIRS : 0;
    int pairs_through = warp_inclusive_sum(my_pairs, lane);         // this warp's lanes 0 .. lane
    int slots_through = warp_inclusive_sum(my_slots, lane);
    int tiles_through = warp_inclusive_sum(my_tiles, lane);
    if (lane == 31) {
        warp_pairs[tid >> 5] = pairs_through;
        warp_slots[tid >> 5] = slots_through;
        warp_tiles[tid >> 5] = tiles_through;
    }
    __syncthreads();
    for (int w = 0; w < (tid >> 5); ++w) {                          // + the warps before this one
        pairs_through += warp_pairs[w];
        slots_through += warp_slots[w];
        tiles_through += warp_tiles[w];
    }
    if (tid == LIST_THREADS - 1) {
        lists[0] = slots_through;              // slots used (the bad-id pseudo expert E is the last, if any)
        lists[3] = tiles_through;              // tiles used (0 without PAIR_TILES)
    }
    int slot = slots_through - my_slots;       // exclusive prefixes: this thread's first slot
    int position = pairs_through - my_pairs;   // and its first position in sorted_pairs
    int tile = tiles_through - my_tiles;       // and its first tile
    (void)tile;
    #pragma unroll
    for (int j = 0; j < LIST_PER; ++j) {
        const int e = e_first + j;
        if (count[j] > 0) {
            expert_of[slot] = e;
            offset_of[slot] = position;
            count_of[slot] = count[j];
            ++slot;
#if PAIR_TILES
            for (int first = 0; first < count[j]; first += TILE_PAIRS, ++tile) {
                TILE_ARRAY(0)[tile] = e;
                TILE_ARRAY(1)[tile] = position + first;
                TILE_ARRAY(2)[tile] = min(TILE_PAIRS, count[j] - first);
                TILE_ARRAY(3)[tile] = first / TILE_PAIRS | (count[j] + TILE_PAIRS - 1) / TILE_PAIRS << 16;
            }
#endif
        }
        if (e == experts) {                     // the bad-id pseudo expert
            lists[1] = pairs - count[j];
            lists[2] = count[j];
        }
        if (e <= experts) running[e] = position;                    // now: expert e's first position
        position += count[j];
    }
    __syncthreads();

    // 3) scatter
    for (int p = tid; p < pairs; p += LIST_THREADS) {
        const int key = key_of[p];
        sorted[running[key] + warp_counts[(p / range) * (experts + 1) + key] + rank_of[p]] = p;
    }
}
#endif  // !PER_PAIR

// A gate_up block's list slot a (< slots, so always in bounds) in ONE round trip: the four loads issue back to
// back (ld_dep: behind the PDL wait, never hoisted above it).
struct ListSlot { int used, expert, count, offset; };
__device__ __forceinline__ ListSlot read_list_slot(const int* lists, int slots, int a) {
    ListSlot s;
    s.used = ld_dep(lists);
    s.expert = ld_dep(list_expert(lists) + a);
    s.count = ld_dep(list_count(lists, slots) + a);
    s.offset = ld_dep(list_offset(lists, slots) + a);
    return s;
}
// The block's exit test reads all four values (the second term is never true for a live slot: expert, count and
// offset are >= 0), so ptxas issues the four loads together instead of sinking three of them below the exit.
__device__ __forceinline__ bool slot_unused(const ListSlot& s, int a) {
    return a >= s.used || (s.expert | s.count | s.offset) < 0;
}

// Register caps: __maxnreg__(N) (CUDA >= 12.4). With only __launch_bounds__(threads) ptxas picks ~64
// registers for mid-size tiles and spills; an explicit cap keeps every default spill-free.
#if GB_MAX_REGS > 0
#define GB_BOUNDS __maxnreg__(GB_MAX_REGS)
#else
#define GB_BOUNDS __launch_bounds__(GB_WARPS * 32)
#endif
#if DB_MAX_REGS > 0
#define DB_BOUNDS __maxnreg__(DB_MAX_REGS)
#else
#define DB_BOUNDS __launch_bounds__(DB_WARPS * 32)
#endif

#if !GB_MMA  // the FMA gate_up (moe_gate_up_batched); GB_MMA 1 compiles moe_gate_up_mma instead
// ------------------------------------------------------------------------------------------------
// gate_up's two steps of a round:
//   load:  lane l's chunks c = base + j*32 + l (j < GB_UNROLL) of every gate and up row it owns
//   round: for each pair of the tile, the same chunks of x[t] (L1 hits) and the FMAs in the strict
//          kernel's per-lane order into gate_acc[tt][o] / up_acc[tt][o] (FP32 registers)
// ------------------------------------------------------------------------------------------------
// (W_FP8: each chunk's block scale too, sg / su: chunk c holds values c * GB_BYTES / 2 .., one 128-block)
template <typename W>
__device__ __forceinline__ void gate_up_load_round(W (&wg)[GB_UNROLL][GB_OUTS], W (&wu)[GB_UNROLL][GB_OUTS],
                                                   float (&sg)[GB_UNROLL][GB_OUTS], float (&su)[GB_UNROLL][GB_OUTS],
                                                   const W* const (&gate_row)[GB_OUTS],
                                                   const W* const (&up_row)[GB_OUTS],
                                                   const float* const (&gate_scale)[GB_OUTS],
                                                   const float* const (&up_scale)[GB_OUTS], int base, int chunks,
                                                   int lane) {
    #pragma unroll
    for (int j = 0; j < GB_UNROLL; ++j) {
        const int c = base + j * 32 + lane;
        const bool ok = c < chunks;
        #pragma unroll
        for (int o = 0; o < GB_OUTS; ++o) {
            wg[j][o] = ldg_chunk(gate_row[o], c, ok);
            wu[j][o] = ldg_chunk(up_row[o], c, ok);
#if W_FP8
            const int block = ok ? c * (GB_BYTES / 2) / FP8_BLOCK : 0;
            sg[j][o] = __ldg(gate_scale[o] + block);
            su[j][o] = __ldg(up_scale[o] + block);
#else
            sg[j][o] = su[j][o] = 1.0f;
#endif
        }
    }
}

template <typename V, typename W>
__device__ __forceinline__ void gate_up_round(const W (&wg)[GB_UNROLL][GB_OUTS], const W (&wu)[GB_UNROLL][GB_OUTS],
                                              const float (&sg)[GB_UNROLL][GB_OUTS],
                                              const float (&su)[GB_UNROLL][GB_OUTS],
                                              const V* const (&x_row)[GB_TILE], int n, int base, int chunks, int lane,
                                              float zero, float (&gate_acc)[GB_TILE][GB_OUTS],
                                              float (&up_acc)[GB_TILE][GB_OUTS]) {
    constexpr int WORDS = sizeof(V) / 4;
    #pragma unroll
    for (int tt = 0; tt < GB_TILE; ++tt) {
        if (tt < n) {                                                // warp-uniform
            V xv[GB_UNROLL];
            #pragma unroll
            for (int j = 0; j < GB_UNROLL; ++j) {
                const int c = base + j * 32 + lane;
                xv[j] = ldg_chunk(x_row[tt], c, c < chunks);
            }
            gate_acc[tt][0] += zero;                                 // += 0.0f, as the strict kernel does
            #pragma unroll
            for (int j = 0; j < GB_UNROLL; ++j) {
                #pragma unroll
                for (int w = 0; w < WORDS; ++w) {
                    const float x_lo = bf16_lo(word(xv[j], w)), x_hi = bf16_hi(word(xv[j], w));
                    #pragma unroll
                    for (int o = 0; o < GB_OUTS; ++o) {
                        float g_lo, g_hi, u_lo, u_hi;
                        weight_pair(wg[j][o], w, sg[j][o], g_lo, g_hi);
                        weight_pair(wu[j][o], w, su[j][o], u_lo, u_hi);
                        gate_acc[tt][o] = fmaf(g_lo, x_lo, gate_acc[tt][o]);
                        gate_acc[tt][o] = fmaf(g_hi, x_hi, gate_acc[tt][o]);
                        up_acc[tt][o] = fmaf(u_lo, x_lo, up_acc[tt][o]);
                        up_acc[tt][o] = fmaf(u_hi, x_hi, up_acc[tt][o]);
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_batched: intermediate[p, i] = bf16(SiLU(w13[e, i, :] . x[t]) * (w13[e, I+i, :] . x[t]))
//   for every pair p = t*K + k routed to expert e.
//   Block b owns list slot a = b / ceil(I / (GB_WARPS*GB_OUTS)) (slots past lists[0] exit at once);
//   its warp w owns neurons i0 .. i0+GB_OUTS-1, i0 = ((b mod that) * GB_WARPS + w) * GB_OUTS, so the
//   block's warps share the expert's x rows in L1. For each tile of GB_TILE of the expert's pairs:
//   lane l loads chunks c = l, l+32, ... (GB_BYTES each) of the gate and up rows ONCE per round
//   (GB_UNROLL rounds of 2*GB_OUTS loads in flight), then the same chunks of x[t] of every pair of the
//   tile, and accumulates gate_acc[tile][o] / up_acc[tile][o] in FP32 registers in strict's per-lane
//   order; warp butterfly; lane o stores neuron i0+o of each pair. Bit-identical to the strict kernel
//   at the same GB_BYTES (lane -> chunk map, FMA order and reduction are the same).
//   The bad-id slot (expert E) writes NaN to its pairs' neurons and reads no weights.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_batched(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const float* __restrict__ s13,            // W_FP8: [E, 2 ceil(I/128), ceil(H/128)]
    const int* __restrict__ lists,            // from moe_expert_lists
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int slots, int n_pairs)
{
    (void)n_pairs;                                                   // the tensor-core gate_up's tile table
    typedef typename Vec<GB_BYTES>::T vec_t;
    typedef typename Vec<GB_WBYTES>::T wvec_t;                       // the weights' chunk (W_FP8: half the bytes)
    const int lane = threadIdx.x & 31;
    const int per_slot = (inter + GB_WARPS * GB_OUTS - 1) / (GB_WARPS * GB_OUTS);   // blocks per slot
    const int a = blockIdx.x / per_slot;
    pdl_wait();  // the lists (and x) come from the kernels before: read only after the wait, through ld_dep
    pdl_release();
    const ListSlot slot = read_list_slot(lists, slots, a);
    if (slot_unused(slot, a)) return;                                // whole block leaves together
    const int i0 = ((blockIdx.x - a * per_slot) * GB_WARPS + (threadIdx.x >> 5)) * GB_OUTS;
    if (i0 >= inter) return;                                         // whole warp leaves together
    const int e = slot.expert;
    const int count = slot.count;
    const int* pairs = sorted_pairs(lists, slots) + slot.offset;
    if (e >= experts) {                                              // bad ids: NaN, no weight read
        for (int j = 0; j < count; ++j) {
            const long long p = __ldg(pairs + j);
            if (lane < GB_OUTS && i0 + lane < inter) intermediate[p * inter + i0 + lane] = BF16_NAN;
        }
        return;
    }

    const int chunks = hidden / (GB_BYTES / 2);                      // H % 8 == 0: whole chunks only
    const int hblocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK, iblocks = (inter + FP8_BLOCK - 1) / FP8_BLOCK;
    const wvec_t* gate_row[GB_OUTS];
    const wvec_t* up_row[GB_OUTS];
    const float* gate_scale[GB_OUTS];
    const float* up_scale[GB_OUTS];
    #pragma unroll
    for (int o = 0; o < GB_OUTS; ++o) {
        const int i = min(i0 + o, inter - 1);                        // past-the-end neurons re-read the last row
        const size_t row = ((size_t)e * 2 * inter + i) * (size_t)hidden;
        gate_row[o] = reinterpret_cast<const wvec_t*>(w13 + row);
        up_row[o] = reinterpret_cast<const wvec_t*>(w13 + row + (size_t)inter * hidden);
        gate_scale[o] = scale_row(s13, (long long)e * 2 * iblocks + i / FP8_BLOCK, hblocks);
        up_scale[o] = scale_row(s13, (long long)e * 2 * iblocks + iblocks + i / FP8_BLOCK, hblocks);
    }

    for (int tile = 0; tile < count; tile += GB_TILE) {              // usually ONE pass (count <= GB_TILE)
        const int n = min(GB_TILE, count - tile);
        const vec_t* x_row[GB_TILE];                                 // x[t] of each pair (past n: a valid row)
        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt) {
            const int p = __ldg(pairs + tile + min(tt, n - 1));      // int: a 32-bit division, no call
            x_row[tt] = reinterpret_cast<const vec_t*>(x + (size_t)(p / top_k) * hidden);
        }
        float gate_acc[GB_TILE][GB_OUTS], up_acc[GB_TILE][GB_OUTS];
        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt)
            #pragma unroll
            for (int o = 0; o < GB_OUTS; ++o) gate_acc[tt][o] = up_acc[tt][o] = 0.0f;

        constexpr int STEP = 32 * GB_UNROLL;                         // chunks per round (all lanes)
        for (int base = 0; base < chunks; base += STEP) {
            // 1) every weight load of the round (2 * GB_OUTS * GB_UNROLL per lane): read once for the tile
            wvec_t wg[GB_UNROLL][GB_OUTS], wu[GB_UNROLL][GB_OUTS];
            float sg[GB_UNROLL][GB_OUTS], su[GB_UNROLL][GB_OUTS];
            gate_up_load_round(wg, wu, sg, su, gate_row, up_row, gate_scale, up_scale, base, chunks, lane);
            const float zero = __uint_as_float(all_loads_arrived(wg) | all_loads_arrived(wu));
            // 2) per pair of the tile: its x chunks (L1 hits), FMAs in the strict kernel's order
            gate_up_round(wg, wu, sg, su, x_row, n, base, chunks, lane, zero, gate_acc, up_acc);
        }

        #pragma unroll
        for (int tt = 0; tt < GB_TILE; ++tt) {
            if (tt < n) {                                            // warp-uniform
                const long long p = __ldg(pairs + tile + tt);
                #pragma unroll
                for (int o = 0; o < GB_OUTS; ++o) {
                    const float g = warp_sum(gate_acc[tt][o]);
                    const float u = warp_sum(up_acc[tt][o]);
                    if (lane == o && i0 + o < inter) {
                        const float silu = g / (1.0f + expf(-g));    // IEEE division (no fast-math)
                        intermediate[p * inter + i0 + o] = f32_to_bf16(silu * u);  // the one bf16 rounding
                    }
                }
            }
        }
    }
}

#endif  // !GB_MMA

// The start of both down kernels: zero the warp's partial, wait for gate_up, release the next kernel. (Measured
// and removed: a bulk L2 prefetch of each warp's first / next expert's w2 block, before the wait or one expert
// ahead -- 1-20 % slower at every point of results/sweep-batched-pdl-*.json.)
__device__ __forceinline__ void down_prologue(float* mine, int partial_floats, int lane) {
    for (int j = lane; j < partial_floats; j += 32) mine[j] = 0.0f;
#if !DOWN_WAITS_LATE
    pdl_wait();     // the intermediate is gate_up's output: every read of it is an ld_dep after this
    pdl_release();
#endif
    __syncwarp();
}

// DB_EARLY_W2: the wait between a round's w2 loads and its intermediate loads, once per warp (warp-uniform).
// Warps without work wait at the end of the loop (down_epilogue_wait) before the block writes anything.
__device__ __forceinline__ void wait_once(bool& waited) {
#if DOWN_WAITS_LATE
    if (!waited) {
        pdl_wait();
        pdl_release();
        waited = true;
    }
#endif
}
__device__ __forceinline__ void down_epilogue_wait() {
#if DOWN_WAITS_LATE
    pdl_wait();     // a no-op once waited
    pdl_release();
#endif
}

// The end of both down kernels (after __syncthreads): every (token, column) of the block sums the DB_WARPS
// partials [w][T][COLUMNS] in warp order and is written once; a token with any expert id outside [0, E)
// gets NaN. Deterministic, no atomics.
template <int COLUMNS>
__device__ __forceinline__ void write_block_outputs(const float* partial, const int* __restrict__ topk_ids,
                                                    void* __restrict__ out, int out_f32, int tokens, int hidden,
                                                    int experts, int top_k, int h0) {
    for (int j = threadIdx.x; j < tokens * COLUMNS; j += DB_WARPS * 32) {
        const int t = j / COLUMNS;
        const int h = h0 + (j - t * COLUMNS);
        if (h >= hidden) continue;
        float v = 0.0f;
        #pragma unroll
        for (int w = 0; w < DB_WARPS; ++w) v = __fadd_rn(v, partial[(size_t)w * tokens * COLUMNS + j]);
        bool bad = false;
        for (int k = 0; k < top_k; ++k) bad |= (unsigned)__ldg(topk_ids + t * top_k + k) >= (unsigned)experts;
        if (bad) v = __int_as_float(0x7fc00000);
        const long long idx = (long long)t * hidden + h;
        if (out_f32) reinterpret_cast<float*>(out)[idx] = v;
        else reinterpret_cast<bf16_t*>(out)[idx] = f32_to_bf16(v);  // the one final rounding
    }
}

#if !DB_MMA  // the FMA down (moe_down_batched); DB_MMA 1 compiles moe_down_mma instead
// ------------------------------------------------------------------------------------------------
// moe_down_batched: out[t, h] = sum over pairs p = t*K + k of topk_weights[p] * (w2[e_p, h, :] . intermediate[p])
//   Block b owns hidden columns h0 .. h0+DB_OUTS-1 (h0 = b * DB_OUTS) for ALL tokens. Warp w takes list
//   slots a = w, w + DB_WARPS, ... (fixed assignment, ascending): lane l loads chunks c = l, l+32, ... of
//   the DB_OUTS rows w2[e, h, :] ONCE per tile of DB_TILE of the expert's pairs (DB_UNROLL rounds of
//   DB_OUTS loads in flight), then the same chunks of each pair's intermediate row (L1/L2 hits); FP32
//   accumulators acc[tile][o] in registers; warp butterfly; lane o adds topk_weight * dot to the warp's
//   own shared-memory partial[w][t][o] (pairs in fixed order, plain adds). After __syncthreads, thread
//   (t, o) sums the DB_WARPS partials in warp order and writes out[t, h0+o] once: deterministic, no atomics.
//   A token with any expert id outside [0, E) gets NaN (its good pairs are computed and ignored).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DB_BOUNDS moe_down_batched(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const float* __restrict__ s2,             // W_FP8: [E, ceil(H/128), ceil(I/128)]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k, int slots)
{
    typedef typename Vec<DB_BYTES>::T vec_t;
    typedef typename Vec<DB_WBYTES>::T wvec_t;                       // the weights' chunk (W_FP8: half the bytes)
    constexpr int WORDS = DB_BYTES / 4;
#ifdef WD_HOST_EMULATION
    float* partial = wdb_dynamic_shared;                             // the CPU emulation's buffer
#else
    extern __shared__ float partial[];                               // [DB_WARPS][T][DB_OUTS]
#endif
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * DB_OUTS;
    float* mine = partial + (size_t)warp * tokens * DB_OUTS;
    down_prologue(mine, tokens * DB_OUTS, lane);

    const int chunks = inter / (DB_BYTES / 2);                       // I % 8 == 0: whole chunks only
    const int hblocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK, iblocks = (inter + FP8_BLOCK - 1) / FP8_BLOCK;
    (void)hblocks;
    const int used = __ldg(lists);
    for (int a = warp; a < used; a += DB_WARPS) {
        const int e = __ldg(list_expert(lists) + a);
        if (e >= experts) continue;                                  // the bad-id slot: NaN below
        const int count = __ldg(list_count(lists, slots) + a);
        const int* pairs = sorted_pairs(lists, slots) + __ldg(list_offset(lists, slots) + a);
        const wvec_t* rows[DB_OUTS];
        const float* row_scale[DB_OUTS];
        #pragma unroll
        for (int o = 0; o < DB_OUTS; ++o) {
            const int h = min(h0 + o, hidden - 1);                   // past-the-end columns re-read the last row
            rows[o] = reinterpret_cast<const wvec_t*>(w2 + ((size_t)e * hidden + h) * inter);
            row_scale[o] = scale_row(s2, (long long)e * hblocks + h / FP8_BLOCK, iblocks);
        }
        for (int tile = 0; tile < count; tile += DB_TILE) {
            const int n = min(DB_TILE, count - tile);
            long long inter_off[DB_TILE];                            // intermediate row of each pair (in chunks)
            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt)
                inter_off[tt] = (long long)__ldg(pairs + tile + min(tt, n - 1)) * chunks;
            float acc[DB_TILE][DB_OUTS];
            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt)
                #pragma unroll
                for (int o = 0; o < DB_OUTS; ++o) acc[tt][o] = 0.0f;

            for (int c0 = 0; c0 < chunks; c0 += 32 * DB_UNROLL) {
                // 1) all DB_UNROLL x DB_OUTS w2 loads of the round (once for the whole tile)
                wvec_t wv[DB_UNROLL][DB_OUTS];
                float sv[DB_UNROLL][DB_OUTS];                        // W_FP8: each chunk's block scale
                #pragma unroll
                for (int r = 0; r < DB_UNROLL; ++r) {
                    const int c = c0 + r * 32 + lane;
                    #pragma unroll
                    for (int o = 0; o < DB_OUTS; ++o) {
                        wv[r][o] = ldg_chunk(rows[o], c, c < chunks);
#if W_FP8
                        sv[r][o] = __ldg(row_scale[o] + (c < chunks ? c * (DB_BYTES / 2) / FP8_BLOCK : 0));
#else
                        sv[r][o] = 1.0f;
#endif
                    }
                }
#if DB_EARLY_INTER
                // 2) ... and the tile's intermediate chunks in the same breath (L2 hits; pairs past n re-read
                //    pair n-1's row, an L1 hit), so their latency overlaps the w2 loads' instead of following it
                vec_t iv[DB_TILE][DB_UNROLL];
                #pragma unroll
                for (int tt = 0; tt < DB_TILE; ++tt)
                    #pragma unroll
                    for (int r = 0; r < DB_UNROLL; ++r) {
                        const int c = c0 + r * 32 + lane;
                        iv[tt][r] = ld_dep_chunk(reinterpret_cast<const vec_t*>(intermediate) + inter_off[tt], c,
                                                 c < chunks);
                    }
                acc[0][0] += __uint_as_float(all_loads_arrived(wv) | all_loads_arrived(iv));  // += 0.0f
#else
                // 2) the intermediate chunks only after every w2 load arrived (the strict kernel's order)
                const vec_t* inter_r = reinterpret_cast<const vec_t*>(intermediate) + all_loads_arrived(wv);
#endif
                // 3) per pair: FMAs into its accumulators (the intermediate chunk shared by the DB_OUTS rows)
                #pragma unroll
                for (int tt = 0; tt < DB_TILE; ++tt) {
                    if (tt < n) {                                    // warp-uniform
                        #pragma unroll
                        for (int r = 0; r < DB_UNROLL; ++r) {
#if DB_EARLY_INTER
                            const vec_t v = iv[tt][r];
#else
                            const int c = c0 + r * 32 + lane;
                            const vec_t v = ld_dep_chunk(inter_r + inter_off[tt], c, c < chunks);
#endif
                            #pragma unroll
                            for (int w = 0; w < WORDS; ++w) {
                                const float a_lo = bf16_lo(word(v, w)), a_hi = bf16_hi(word(v, w));
                                #pragma unroll
                                for (int o = 0; o < DB_OUTS; ++o) {
                                    float w_lo, w_hi;
                                    weight_pair(wv[r][o], w, sv[r][o], w_lo, w_hi);
                                    acc[tt][o] = fmaf(w_lo, a_lo, acc[tt][o]);
                                    acc[tt][o] = fmaf(w_hi, a_hi, acc[tt][o]);
                                }
                            }
                        }
                    }
                }
            }

            #pragma unroll
            for (int tt = 0; tt < DB_TILE; ++tt) {
                if (tt < n) {                                        // warp-uniform
                    const int p = __ldg(pairs + tile + tt);
                    const float weight = __ldg(topk_weights + p);
                    const int t = p / top_k;
                    #pragma unroll
                    for (int o = 0; o < DB_OUTS; ++o) {
                        const float dot = warp_sum(acc[tt][o]);
                        if (lane == o) mine[t * DB_OUTS + o] = __fadd_rn(mine[t * DB_OUTS + o], __fmul_rn(weight, dot));
                    }
                }
            }
        }
    }
    __syncthreads();

    // every (token, column) of the block: the warps' partials in warp order, written once
    write_block_outputs<DB_OUTS>(partial, topk_ids, out, out_f32, tokens, hidden, experts, top_k, h0);
}

#endif  // !DB_MMA

#if GB_MMA || DB_MMA
// ------------------------------------------------------------------------------------------------
// Tensor-core variants (GB_MMA / DB_MMA 1; sm_80+): the same ownership -- a warp owns output rows of ONE
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
// The A rows' chunk of 8 values: 8 bf16 (16 bytes) or, with W_FP8, 8 e4m3fn (8 bytes) widened to bf16 in
// registers. A lane's load per A row and k block (a_load_t) is one chunk, or two with FP8_LOAD16 (MMA_HALVES).
#if W_FP8
typedef uint2 a_chunk_t;
#else
typedef uint4 a_chunk_t;
#endif
#if W_FP8 && FP8_LOAD16
typedef uint4 a_load_t;
#define MMA_HALVES 2
#else
typedef a_chunk_t a_load_t;
#define MMA_HALVES 1
#endif
#define MMA_KB (4 * MMA_HALVES)                      // chunks of 8 values per k block: 32- or 64-wide
// half h of a lane's A load as a bf16 fragment (W_FP8: value x 2^-112)
__device__ __forceinline__ uint4 a_fragment(const uint4& v, int h) {
#if W_FP8
    return e4m3x8_to_bf16x8(h == 0 ? make_uint2(v.x, v.y) : make_uint2(v.z, v.w));
#else
    (void)h;
    return v;
#endif
}
__device__ __forceinline__ uint4 a_fragment(const uint2& v, int h) { (void)h; return e4m3x8_to_bf16x8(v); }
// a lane's B chunk (8 bf16 activations) as its fragment: as loaded, or with FP8_PRMT 2 times 2^8 (the factor the
// A fragments' widening leaves out; kernels/device_helpers.py). FP8_PRMT 3: the gate_up writes the intermediate
// already x 2^8 (intermediate_value), so the down's B (PRE_SCALED_B: COLS_DEP) is taken as loaded.
#define INTER_X256 (W_FP8 && FP8_PRMT == 3)
template <bool PRE_SCALED_B = false>
__device__ __forceinline__ uint4 b_fragment(const uint4& v) {
#if W_FP8 && FP8_PRMT >= 2
    if (INTER_X256 && PRE_SCALED_B) return v;
    return make_uint4(bf16x2_times_256(v.x), bf16x2_times_256(v.y), bf16x2_times_256(v.z), bf16x2_times_256(v.w));
#else
    return v;
#endif
}
// The tensor-core gate_up's intermediate value: the one bf16 rounding of SiLU(g) x u, then with FP8_PRMT 3 x 2^8
// (exact below 2^120; NaN and infinities stay)
__device__ __forceinline__ bf16_t intermediate_value(float v) {
    const bf16_t r = f32_to_bf16(v);
    if (!INTER_X256) return r;
    return f32_to_bf16(__uint_as_float((u32)r << 16) * 256.0f);
}
// W_FP8: acc += part x 2^112 x the block's scale (s_lo for rows g -- acc[0], acc[1] --, s_hi for rows g + 8), part
// zeroed for the next block
__device__ __forceinline__ void fp8_flush(float (&acc)[4], float (&part)[4], float s_lo, float s_hi) {
    acc[0] = fmaf(part[0] * FP8_UNSCALE, s_lo, acc[0]);
    acc[1] = fmaf(part[1] * FP8_UNSCALE, s_lo, acc[1]);
    acc[2] = fmaf(part[2] * FP8_UNSCALE, s_hi, acc[2]);
    acc[3] = fmaf(part[3] * FP8_UNSCALE, s_hi, acc[3]);
    part[0] = part[1] = part[2] = part[3] = 0.0f;
}

// A tensor-core warp's two A rows of one expert (rows g and g + 8 of its 16) and their block scales along k: w13's
// gate row i and up row i (w13_rows), or w2's rows h_lo and h_hi (w2_rows)
struct ARows { const a_chunk_t* lo; const a_chunk_t* hi; const float* scale_lo; const float* scale_hi; };
// W_TILED (fp8-block128-t16 or bf16-t16, kernels/formats.py): the values of TILE_ROWS rows x TILE_K k are one
// contiguous tile of TILE_ROWS x TILE_ROW_BYTES bytes, k block after k block (w13: neuron group i / 8's gate rows, then
// its up rows; w2: rows 16t .. 16t + 15). A row's pointer is its tile's first k block plus its row in the tile
// (tile_row); a_index maps the row-major 16-byte index to the tiled one. The mma's A operand is 16 rows x 64 bytes per
// k block (4 loads of 16 bytes a row: 64 e4m3 or 32 bf16 values): one tile.
#define TILE_K (TILE_ROW_BYTES / (int)sizeof(weight_t))   // values per tile row
#define TILE_VALUES (TILE_ROWS * TILE_K)
#define TILE_CHUNKS (TILE_ROW_BYTES / 16)                   // 16-byte loads per tile row, and per tile:
#define TILE_LOADS (TILE_ROWS * TILE_CHUNKS)
static_assert(TILE_ROWS == 16 && TILE_ROW_BYTES == 64, "W_TILED reads one tile per mma k block: 16 rows x 64 bytes");
__device__ __forceinline__ int a_index(int idx) {
    return W_TILED ? idx + (idx / TILE_CHUNKS) * (TILE_LOADS - TILE_CHUNKS) : idx;
}
// row r of a tiled matrix with `cols` values per row, whose tiles hold `rows_per_tile` of its rows (in values)
__device__ __forceinline__ size_t tile_row(int r, int cols, int rows_per_tile) {
    return (size_t)(r / rows_per_tile) * (cols / TILE_K) * TILE_VALUES + (size_t)(r % rows_per_tile) * TILE_K;
}
__device__ __forceinline__ ARows w13_rows(const weight_t* w13, const float* s13, int e, int i, int hidden, int inter) {
    const int hblocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK, iblocks = (inter + FP8_BLOCK - 1) / FP8_BLOCK;
    const size_t expert = (size_t)e * 2 * inter * hidden;
    // a w13 tile: TILE_ROWS / 2 gate rows, then the same neurons' up rows
    const size_t gate = expert + (W_TILED ? tile_row(i, hidden, TILE_ROWS / 2) : (size_t)i * hidden);
    const size_t up = W_TILED ? gate + (TILE_ROWS / 2) * TILE_K : gate + (size_t)inter * hidden;
    return {reinterpret_cast<const a_chunk_t*>(w13 + gate),
            reinterpret_cast<const a_chunk_t*>(w13 + up),
            scale_row(s13, (long long)e * 2 * iblocks + i / FP8_BLOCK, hblocks),
            scale_row(s13, (long long)e * 2 * iblocks + iblocks + i / FP8_BLOCK, hblocks)};
}
__device__ __forceinline__ size_t w2_row(int e, int h, int hidden, int inter) {
    return (size_t)e * hidden * inter + (W_TILED ? tile_row(h, inter, TILE_ROWS) : (size_t)h * inter);
}
__device__ __forceinline__ ARows w2_rows(const weight_t* w2, const float* s2, int e, int h_lo, int h_hi, int hidden,
                                         int inter) {
    const int hblocks = (hidden + FP8_BLOCK - 1) / FP8_BLOCK, iblocks = (inter + FP8_BLOCK - 1) / FP8_BLOCK;
    return {reinterpret_cast<const a_chunk_t*>(w2 + w2_row(e, h_lo, hidden, inter)),
            reinterpret_cast<const a_chunk_t*>(w2 + w2_row(e, h_hi, hidden, inter)),
            scale_row(s2, (long long)e * hblocks + h_lo / FP8_BLOCK, iblocks),
            scale_row(s2, (long long)e * hblocks + h_hi / FP8_BLOCK, iblocks)};
}

// Range r of GB_KSPLIT over `chunks` chunks of 8 values: whole k blocks, ceil(chunks / GB_KSPLIT) rounded up to
// MMA_KB chunks each (the last ranges may be short or empty); H (and the knobs) alone fix it.
__device__ __forceinline__ void k_range(int chunks, int r, int& begin, int& end) {
    const int size = ((chunks + GB_KSPLIT - 1) / GB_KSPLIT + MMA_KB - 1) / MMA_KB * MMA_KB;
    begin = min(r * size, chunks);
    end = min(begin + size, chunks);
}

// GB_SHARE / DB_SHARE: a group of warps' shared A fragments (the group's region of the block's a_share, two round
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
#define GB_HOT_ROUNDS (GB_HOT_UNROLL > 0 ? GB_HOT_UNROLL : HOT_UNROLL(GB_UNROLL, GB_NBLK))
#define GB_SHARE_UNROLL (HOT_GB ? GB_HOT_ROUNDS : GB_UNROLL)
#define DB_SHARE_UNROLL (HOT_DB ? DB_HOT_ROUNDS : DB_UNROLL)
static_assert(GB_SHARE <= 1 || GB_WARPS / 2 * 2 * SHARE_ROUND(GB_SHARE_UNROLL, 1) * 16 <= 48 * 1024,
              "GB_SHARE: the groups' A buffers exceed 48 KB of static shared memory (fewer GB_WARPS or GB_UNROLL)");
static_assert(DB_SHARE <= 1 || DB_WARPS / 2 * 2 * SHARE_ROUND(DB_SHARE_UNROLL, DB_ROW_TILES) * 16 <= 48 * 1024,
              "DB_SHARE: the groups' A buffers exceed 48 KB of static shared memory (fewer DB_WARPS or DB_UNROLL)");

// One round of a warp's k range (below): UNROLL k blocks from chunk c0. CHECKED: some k block may lie past c_end
// (a lane past the end loads chunk 0 and uses zeros); unchecked rounds are whole, with no masking (the bounds
// selects were ~15 % of an FP8 round's instructions).
// RT row tiles (tiles[t]: rows 16t + g and 16t + g + 8 of the warp's) share each B fragment; acc[t * NB + nb].
// SHARED (GB_SHARE / DB_SHARE): the warp loads and widens only its group's k blocks j with j mod m == member (before
// a dependent B's wait, as its own A loads would be) into the round's buffer; after the block barrier every member
// reads all UNROLL k blocks' fragments there.
template <int UNROLL, int NB, bool COLS_DEP, bool CHECKED, int RT = 1, bool SHARED = false>
__device__ __forceinline__ void mma_round(float (&acc)[RT * NB][4], float (&part)[RT * NB][4],
                                          const ARows (&tiles)[RT], const uint4* const (&cols)[NB], int c0, int c_end,
                                          int q, bool& waited, AShare* share = nullptr) {
    constexpr int OWN = SHARED ? (UNROLL + 1) / 2 : UNROLL;          // A loads per lane: SHARED, its k blocks only
    a_load_t lo[OWN][RT], hi[OWN][RT];                                // (groups of 2 or 4: at most half of them)
    uint4 col[UNROLL][NB][MMA_HALVES];
#if W_FP8
    float s_lo[UNROLL][RT], s_hi[UNROLL][RT];
    bool flush[UNROLL];
#else
    (void)part;
#endif
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
#if W_FP8
        const int first = c0 + MMA_KB * j, next = first + MMA_KB;           // k block j's chunks: first .. next-1
        flush[j] = !FP8_BLOCK_SUM || next % (FP8_BLOCK / 8) == 0 || next >= c_end;
        const int block = flush[j] && (!CHECKED || first < c_end) ? first / (FP8_BLOCK / 8) : 0;
        #pragma unroll
        for (int t = 0; t < RT; ++t) {  // a down's rows (16 RT from a multiple of 16 RT) share one scale row
            s_lo[j][t] = COLS_DEP && t > 0 ? s_lo[j][0] : flush[j] ? __ldg(tiles[t].scale_lo + block) : 0.0f;
            s_hi[j][t] = COLS_DEP ? s_lo[j][t] : flush[j] ? __ldg(tiles[t].scale_hi + block) : 0.0f;
        }
#endif
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
                    shared_a[(((j * MMA_HALVES + h) * RT + t) * 2) * 32 + lane] = a_fragment(lo[i][t], h);
                    shared_a[(((j * MMA_HALVES + h) * RT + t) * 2 + 1) * 32 + lane] = a_fragment(hi[i][t], h);
                }
        }
        __syncthreads();  // the group's fragments are in; the other buffer's last readers have passed this barrier
    } else {
#if W_FP8
        part[0][0] += __uint_as_float(all_loads_arrived(lo) | all_loads_arrived(hi));  // += 0.0f, before any mma
#else
        acc[0][0] += __uint_as_float(all_loads_arrived(lo) | all_loads_arrived(hi));   // += 0.0f
#endif
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
                    a_lo = a_fragment(lo[j][t], h);
                    a_hi = a_fragment(hi[j][t], h);
                }
                #pragma unroll
                for (int nb = 0; nb < NB; ++nb) {
#if W_FP8
                    mma_k32(part[t * NB + nb], a_lo, a_hi, b[nb]);
#else
                    mma_k32(acc[t * NB + nb], a_lo, a_hi, b[nb]);
#endif
                }
            }
        }
#if W_FP8
        if (flush[j]) {                                              // warp-uniform
            #pragma unroll
            for (int t = 0; t < RT; ++t)
                #pragma unroll
                for (int nb = 0; nb < NB; ++nb)
                    fp8_flush(acc[t * NB + nb], part[t * NB + nb], s_lo[j][t], s_hi[j][t]);
        }
#endif
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
// loads and after wait_once (DB_EARLY_W2: the first round's A loads are issued before the PDL wait).
// W_FP8: scale_lo / scale_hi are the two rows' block scales along k (a k block lies in one 128-block; a down's
// rows -- COLS_DEP: 16 per tile from a multiple of 16, past-the-end rows clamped to the last -- lie in one 128-row
// block, so it loads scale_lo of its first tile alone); the mma
// results go to a partial that is scaled into acc at the end of each k block, or with FP8_BLOCK_SUM at the end of
// each scale block and of the range.
#define MASKED_ROUNDS 0
#define WHOLE_ROUNDS 1
#define ONLY_WHOLE_ROUNDS 2
// results/sweep-2026-12-02-whole-rounds-*.json
#define GATE_UP_ROUNDS (W_FP8 || GB_KSPLIT == 1 ? WHOLE_ROUNDS : MASKED_ROUNDS)
#define DOWN_GROUPED_ROUNDS (W_FP8 ? WHOLE_ROUNDS : DB_WHOLE_RANGES ? ONLY_WHOLE_ROUNDS : MASKED_ROUNDS)
// RT row tiles per warp (mma_round): acc[t * NB + nb]; mma_rows_by_columns is the one-tile form.
template <int UNROLL, int NB, bool COLS_DEP, int ROUNDS, int RT, bool SHARED = false>
__device__ __forceinline__ void mma_tiles_by_columns(float (&acc)[RT * NB][4], const ARows (&tiles)[RT],
                                                     const uint4* const (&cols)[NB], int c_begin, int c_end, int q,
                                                     bool& waited, AShare* share = nullptr) {
    float part[RT * NB][4];                                          // W_FP8: a scale block's mma sums
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
                                                    const a_chunk_t* rows_hi, const float* scale_lo,
                                                    const float* scale_hi, const uint4* const (&cols)[NB],
                                                    int c_begin, int c_end, int q, bool& waited,
                                                    AShare* share = nullptr) {
    const ARows tiles[1] = {{rows_lo, rows_hi, scale_lo, scale_hi}};
    mma_tiles_by_columns<UNROLL, NB, COLS_DEP, ROUNDS, 1, SHARED>(acc, tiles, cols, c_begin, c_end, q, waited, share);
}
#endif

#if GB_MMA && GB_RANGE_FLUSH
// GB_RANGE_FLUSH (GB_KSPLIT > 1, every range a whole number of rounds -- the host checks): the split-chain
// gate_up's sums in one loop over H. Each range's chain starts from zero and is added to the total at the range's end
// (range 0's becomes it, the next ones through __fadd_rn in range order), and each empty range past H adds +0.0f --
// the same operations on the same values as one mma_rows_by_columns call per range, without a loop per range
// (whole rounds unmasked, a masked last round only at the end of H): 2-4 % faster on the H200 (bf16). W_FP8: the
// scale block's partial lives across rounds as in one range's loop; a range ends on a scale block's end (the host
// checks it with FP8_BLOCK_SUM), where mma_round has flushed it into the range's chain.
// SHARED (GB_SHARE): every round's A fragments come through the warp's group (mma_round); the chains are unchanged.
template <int NB, int UNROLL, bool SHARED = false>
__device__ __forceinline__ void split_chain_one_loop(float (&total)[NB][4], const ARows& rows,
                                                     const uint4* const (&cols)[NB], int chunks, int q, bool& waited,
                                                     AShare* share = nullptr) {
    constexpr int ROUND = MMA_KB * UNROLL;
    int zero, size;
    k_range(chunks, 0, zero, size);                                  // range 0: chunks 0 .. size - 1
    float part[NB][4], scale_part[NB][4];                            // W_FP8: the scale block's mma sums
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
#endif

#if GB_MMA && !PER_PAIR
// A tensor-core gate_up block's work unit, read in ONE round trip after the PDL wait: with PAIR_TILES tile a of
// the tile table (its pairs: up to TILE_PAIRS, one pass), else list slot a (all its pairs).
// With GB_SHARE, run: the tile's place in its expert's run of tiles (tile_run).
struct GateUpItem { int expert, count; const int* pairs; bool unused; int run; };
__device__ __forceinline__ GateUpItem read_gate_up_item(const int* lists, int slots, int pairs, int a) {
#if PAIR_TILES
    const int used = ld_dep(lists + 3);
    const int expert = ld_dep(TILE_ARRAY(0) + a), first = ld_dep(TILE_ARRAY(1) + a), count = ld_dep(TILE_ARRAY(2) + a);
    const int run = GB_SHARE > 1 ? ld_dep(TILE_ARRAY(3) + a) : 0;
    return {expert, count, sorted_pairs(lists, slots) + first, a >= used || (expert | first | count) < 0, run};
#else
    const ListSlot s = read_list_slot(lists, slots, a);
    return {s.expert, s.count, sorted_pairs(lists, slots) + s.offset, slot_unused(s, a), 0};
#endif
}

// A gate_up warp's passes over `count` pairs (pairs[0 .. count - 1]) of expert rows `rows`: NB 8-pair blocks per
// pass, UNROLL k blocks of loads in flight per lane; lane (g, q) writes the intermediate of neuron i0 + g.
// SHARED (GB_SHARE): one pass (count <= 8 NB) whose A fragments the warp's group shares (mma_round).
template <int NB, int UNROLL, bool SHARED = false>
__device__ __forceinline__ void gate_up_passes(const ARows& rows, const bf16_t* __restrict__ x, const int* pairs,
                                               int count, bf16_t* __restrict__ intermediate, int hidden, int inter,
                                               int top_k, int i0, int g, int q, AShare* share = nullptr) {
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
                    const float gate = acc[nb][h], up = acc[nb][2 + h];
                    const float silu = gate / (1.0f + expf(-gate));  // IEEE division (no fast-math)
                    intermediate[p * inter + i0 + g] = intermediate_value(silu * up);  // the one bf16 rounding
                }
            }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_mma: block b owns work unit a (a list slot as moe_gate_up_batched, or with PAIR_TILES a tile of
//   one slot's pairs); its warp w owns neurons i0 .. i0+7,
//   i0 = ((b mod per_slot) * GB_WARPS + w) * 8: A rows 0..7 = gate rows i0+g, rows 8..15 = up rows i0+g, so
//   lane (g, q) ends with gate AND up of neuron i0+g for pairs 2q, 2q+1 of each 8-pair block -- SiLU(g) * u
//   and the one bf16 rounding happen in the lane, no shuffle. B column g = x[token of pair g] (L1 hits).
//   GB_NBLK blocks of 8 pairs per pass (A shared), GB_UNROLL k blocks of loads in flight per lane; with HOT_GB a
//   tile of more than 8 * GB_NBLK pairs (a hot expert's) in one pass of HOT_NBLK blocks.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_mma(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const float* __restrict__ s13,            // W_FP8: [E, 2 ceil(I/128), ceil(H/128)]
    const int* __restrict__ lists,            // from moe_expert_lists
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int slots, int n_pairs)
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
        gate_up_passes<HOT_GB ? HOT_NBLK : GB_NBLK, GB_SHARE_UNROLL, true>(rows, x, mine.pairs, mine.count,
                                                                           intermediate, hidden, inter, top_k, i0, g,
                                                                           q, &share);
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
                                                q);
        return;
    }
#endif
    gate_up_passes<GB_NBLK, GB_UNROLL>(rows, x, pairs, count, intermediate, hidden, inter, top_k, i0, g, q);
}
#endif

#if DB_MMA
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
                                               const weight_t* __restrict__ w2, const float* __restrict__ s2,
                                               float* mine, int hidden, int inter, int top_k, int h_lo, int h_hi,
                                               int g, int q, bool& waited) {
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

__device__ __forceinline__ void down_mma_slot(const DownLists& m, int a, int c_begin, int c_end,
                                              const bf16_t* __restrict__ intermediate,
                                              const weight_t* __restrict__ w2, const float* __restrict__ s2,
                                              float* mine, int hidden, int inter, int top_k, int h_lo, int h_hi,
                                              int g, int q, bool& waited) {
    down_mma_pairs(m, __ldg(m.expert + a), m.pairs + __ldg(m.offset + a), __ldg(m.count + a), c_begin, c_end,
                   intermediate, w2, s2, mine, hidden, inter, top_k, h_lo, h_hi, g, q, waited);
}

#if !DB_GROUPED && !PER_PAIR  // the grouped down (below) or the per-token down replaces it
// ------------------------------------------------------------------------------------------------
// moe_down_mma: block b owns hidden columns h0 .. h0+15 (h0 = 16 b) for ALL tokens. Its warps share the list
//   slots (bad-id slot excluded: NaN at the end) in one of two ways, each a fixed schedule:
//   * DB_BALANCE 0: warp w takes slots w, w + DB_WARPS, ... whole (k range = the full row);
//   * DB_BALANCE 1: the (slot, k block) items in slot-major order are cut into DB_WARPS contiguous runs of
//     equal length (+-1), warp w the w-th -- every warp streams the same bytes, crossing slot boundaries;
//     with PAIR_TILES the (tile, k block) items of the tile table instead: an expert weighs its tiles.
//   Per slot (down_mma_slot): A = w2[e, h0 .. h0+15, k range] x B = the pairs' intermediate rows, FP32 in the
//   tensor core, adds into the warp's shared partial[w][t][16]. After __syncthreads the warps' partials are
//   summed in warp order: deterministic, no atomics.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void DB_BOUNDS moe_down_mma(
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const float* __restrict__ s2,             // W_FP8: [E, ceil(H/128), ceil(I/128)]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k, int slots)
{
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
#if DB_BALANCE
    const int kblocks = (chunks + MMA_KB - 1) / MMA_KB;              // k blocks (32- or 64-wide)
#if PAIR_TILES
    const int pairs = tokens * top_k;                                // (TILE_ARRAY's names)
    const int units = __ldg(lists + 3) - (__ldg(lists + 2) + TILE_PAIRS - 1) / TILE_PAIRS;   // the good tiles
#else
    const int units = m.good;                                        // the good slots
#endif
    const long long items = (long long)units * kblocks;              // (unit, k block), unit-major
    int item = (int)(items * warp / DB_WARPS);
    const int item_end = (int)(items * (warp + 1) / DB_WARPS);
    while (item < item_end) {                                        // warp-uniform
        const int a = item / kblocks;
        const int kb = item - a * kblocks;
        const int kb_end = min(kblocks, kb + (item_end - item));
#if PAIR_TILES
        down_mma_pairs(m, __ldg(TILE_ARRAY(0) + a), m.pairs + __ldg(TILE_ARRAY(1) + a), __ldg(TILE_ARRAY(2) + a),
                       MMA_KB * kb, min(MMA_KB * kb_end, chunks), intermediate, w2, s2, mine, hidden, inter, top_k,
                       h_lo, h_hi, g, q, waited);
#else
        down_mma_slot(m, a, MMA_KB * kb, min(MMA_KB * kb_end, chunks), intermediate, w2, s2, mine, hidden, inter,
                      top_k, h_lo, h_hi, g, q, waited);
#endif
        item += kb_end - kb;
    }
#else
    for (int a = warp; a < m.good; a += DB_WARPS)
        down_mma_slot(m, a, 0, chunks, intermediate, w2, s2, mine, hidden, inter, top_k, h_lo, h_hi, g, q, waited);
#endif
    down_epilogue_wait();
    __syncthreads();

    write_block_outputs<16>(partial, topk_ids, out, out_f32, tokens, hidden, experts, top_k, h0);
}
#endif  // !DB_GROUPED

#if DB_GROUPED
// The grouped down warp's passes over a tile's `count` pairs (tile_pairs[0 .. count - 1]): NB 8-pair blocks per pass,
// UNROLL k blocks of loads in flight per lane; lane (g, q) writes rows h0+16t+g, h0+16t+g+8 of its pairs' FP32 rows
// for each of the RT row tiles t it is given.
// SHARED (DB_SHARE): one pass (count <= 8 NB) whose A fragments the warp's group shares (mma_round).
template <int NB, int UNROLL, int RT, bool SHARED = false>
__device__ __forceinline__ void down_grouped_passes(const ARows (&tiles)[RT], const int* tile_pairs,
                                                    int count, const bf16_t* __restrict__ intermediate,
                                                    const float* __restrict__ topk_weights,
                                                    float* __restrict__ pair_out, int hidden, int inter, int h0, int g,
                                                    int q, bool& waited, AShare* share = nullptr) {
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
                        if (h_t < hidden) row[h_t] = __fmul_rn(weight, acc[t * NB + nb][h]);
                        if (h_t + 8 < hidden) row[h_t + 8] = __fmul_rn(weight, acc[t * NB + nb][2 + h]);
                    }
                }
            }
    }
}

// ------------------------------------------------------------------------------------------------
// moe_down_grouped (DB_GROUPED): the down as one grouped GEMM over the tile table, like the tensor-core gate_up.
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
    const float* __restrict__ s2,             // W_FP8: [E, ceil(H/128), ceil(I/128)]
    const float* __restrict__ topk_weights,   // [T, K]
    const int* __restrict__ lists,            // from moe_expert_lists (the tile table)
    float* __restrict__ pair_out,             // [T*K, H] FP32: each pair's weighted expert output
    int hidden, int inter, int experts, int top_k, int slots, int pairs)
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
#if !DOWN_WAITS_LATE
        pdl_wait();
        pdl_release();
#endif
        bool waited = false;
        ARows tiles[DB_ROW_TILES];
        #pragma unroll
        for (int t = 0; t < DB_ROW_TILES; ++t)
            tiles[t] = w2_rows(w2, s2, e, min(rows0 + 16 * t + g, hidden - 1),
                               min(rows0 + 16 * t + g + 8, hidden - 1), hidden, inter);
        AShare share{a_share[seat.set], seat.member, members, 0};
        down_grouped_passes<HOT_DB ? HOT_NBLK : DB_NBLK, DB_SHARE_UNROLL, DB_ROW_TILES, true>(
            tiles, tile_pairs, mine_count, intermediate, topk_weights, pair_out, hidden, inter, rows0, g, q, waited,
            &share);
        down_epilogue_wait();
        return;
    }
#endif
#if !DOWN_WAITS_LATE
    pdl_wait();     // the intermediate is gate_up's output: every read of it is an ld_dep after this
    pdl_release();
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
                                                                       q, waited);
        } else
#endif
            down_grouped_passes<DB_NBLK, DB_UNROLL, DB_ROW_TILES>(tiles, tile_pairs, count, intermediate, topk_weights,
                                                                  pair_out, hidden, inter, h0, g, q, waited);
    }
    down_epilogue_wait();  // warps that never waited (no work, or DB_EARLY_W2 off) before the grid may end
}

// ------------------------------------------------------------------------------------------------
// moe_sum_slots (DB_GROUPED): out[t, h] = sum over k = 0 .. K-1, in slot order from 0.0f, of pair_out[t*K + k, h]
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

#if PER_PAIR
// Block b of a per-pair kernel over `count` items (pairs, or tokens in the down) of `per` blocks each: (item, block
// of it) -- item-major, or with PAIRS_INNER items fastest, so that items sharing an expert read its rows together.
__device__ __forceinline__ int2 pair_block(unsigned b, int count, int per) {   // b: blockIdx.x
    const int item = PAIRS_INNER ? b % count : b / per;
    return make_int2(item, PAIRS_INNER ? b / count : b - item * per);
}

// ------------------------------------------------------------------------------------------------
// moe_gate_up_pair (PER_PAIR): block b owns pair p = b / per_pair (PAIRS_INNER: b % pairs, so that pairs sharing an
//   expert read its rows back to back) and GB_WARPS / GB_KSPLIT groups of 8 neurons of it; warp w works on group
//   w / GB_KSPLIT over k range w % GB_KSPLIT, as moe_gate_up_mma does for a tile -- A rows 0..7 gate, 8..15 up, the
//   same mma chains -- with the pair's x row in every B column. Lane (g, 0) of a group's
//   range-0 warp adds the ranges' column-0 partials in range order (through shared memory when GB_KSPLIT > 1) and
//   writes neuron i0+g. A bad id writes NaN and reads no weights. No warp leaves before the block barrier.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void GB_BOUNDS moe_gate_up_pair(
    const bf16_t* __restrict__ x,             // [T, H]
    const weight_t* __restrict__ w13,         // [E, 2I, H]
    const float* __restrict__ s13,            // W_FP8: [E, 2 ceil(I/128), ceil(H/128)]
    const int* __restrict__ topk_ids,         // [T, K]
    bf16_t* __restrict__ intermediate,        // [T, K, I]
    int hidden, int inter, int experts, int top_k, int pairs)
{
#if GB_KSPLIT == 1  // one chain over H per warp: nothing shared, no barrier
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int per_pair = (inter + GB_WARPS * 8 - 1) / (GB_WARPS * 8);
    const int2 pb = pair_block(blockIdx.x, pairs, per_pair);
    const int p = pb.x;
    const int i0 = (pb.y * GB_WARPS + (threadIdx.x >> 5)) * 8;
    pdl_wait();  // topk_ids and x may come from the kernel right before
    pdl_release();
    if (p >= pairs || i0 >= inter) return;                           // whole warp leaves together
    const int e = ld_dep(topk_ids + p);
    if ((unsigned)e >= (unsigned)experts) {
        if (lane < 8 && i0 + lane < inter) intermediate[(long long)p * inter + i0 + lane] = BF16_NAN;
        return;
    }
    const ARows rows = w13_rows(w13, s13, e, min(i0 + g, inter - 1), hidden, inter);   // past the end: the last row
    const uint4* x_row[1] = {reinterpret_cast<const uint4*>(x + (size_t)(p / top_k) * hidden)};
    float acc[1][4];
    bool unused = true;
    mma_rows_by_columns<GB_UNROLL, 1, false>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi, x_row, 0,
                                             hidden / 8, q, unused);
    if (q == 0 && i0 + g < inter) {                                  // column 0: the pair
        const float gate = acc[0][0], up = acc[0][2];
        const float silu = gate / (1.0f + expf(-gate));              // IEEE division (no fast-math)
        intermediate[(long long)p * inter + i0 + g] = intermediate_value(silu * up);  // the one bf16 rounding
    }
#else  // a warp per (8 neurons, k range); the ranges' partials meet in shared memory
    constexpr int GROUPS = GB_WARPS / GB_KSPLIT;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5, range = w % GB_KSPLIT;
    const int per_pair = (inter + GROUPS * 8 - 1) / (GROUPS * 8);
    const int2 pb = pair_block(blockIdx.x, pairs, per_pair);
    const int p = pb.x;
    const int i0 = (pb.y * GROUPS + w / GB_KSPLIT) * 8;
    pdl_wait();  // topk_ids and x may come from the kernel right before
    pdl_release();
    const bool live = p < pairs && i0 < inter;                       // a group's warps agree
    const int e = live ? ld_dep(topk_ids + p) : 0;
    const bool bad = live && (unsigned)e >= (unsigned)experts;
    float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
    if (live && !bad) {
        const ARows rows = w13_rows(w13, s13, e, min(i0 + g, inter - 1), hidden, inter);   // past the end: the last
        const uint4* x_row[1] = {reinterpret_cast<const uint4*>(x + (size_t)(p / top_k) * hidden)};
        bool unused = true;
        int k_begin, k_end;
        k_range(hidden / 8, range, k_begin, k_end);
        mma_rows_by_columns<GB_UNROLL, 1, false>(acc, rows.lo, rows.hi, rows.scale_lo, rows.scale_hi, x_row, k_begin,
                                                 k_end, q, unused);
    }
    __shared__ float partial[GB_WARPS][16];                          // [warp][gate rows 0..7, up rows 0..7]
    if (q == 0) {                                                    // column 0: the pair
        partial[w][g] = acc[0][0];
        partial[w][8 + g] = acc[0][2];
    }
    __syncthreads();
    const int first = w - range;                                     // the group's range-0 warp
    float gate = partial[first][g], up = partial[first][8 + g];      // column 0: the pair
    for (int r = 1; r < GB_KSPLIT; ++r) {                            // range order, from range 0
        gate = __fadd_rn(gate, partial[first + r][g]);
        up = __fadd_rn(up, partial[first + r][8 + g]);
    }
    if (!live || range != 0) return;
    if (bad) {
        if (lane < 8 && i0 + lane < inter) intermediate[(long long)p * inter + i0 + lane] = BF16_NAN;
        return;
    }
    if (q == 0 && i0 + g < inter) {
        const float silu = gate / (1.0f + expf(-gate));              // IEEE division (no fast-math)
        intermediate[(long long)p * inter + i0 + g] = intermediate_value(silu * up);  // the one bf16 rounding
    }
#endif
}

// ------------------------------------------------------------------------------------------------
// moe_down_token (PER_PAIR): block b owns token t = b / per_token (PAIRS_INNER: b % tokens) and hidden rows
//   h0 .. h0+15; its K warps (one per
//   slot) run the grouped down's mma chain over all of I for the pair (t, k) (its intermediate row in every column)
//   and keep topk_weight * dot of column 0 in shared memory; thread r < 16 then sums the K rows in slot order from
//   0.0f and rounds once -- moe_down_grouped + moe_sum_slots' numerics. A token with a bad id gets NaN and reads no
//   weight of that slot.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(512, 1) moe_down_token(   // K <= 16 warps: <= 128 registers
    const bf16_t* __restrict__ intermediate,  // [T, K, I]
    const weight_t* __restrict__ w2,          // [E, H, I]
    const float* __restrict__ s2,             // W_FP8: [E, ceil(H/128), ceil(I/128)]
    const int* __restrict__ topk_ids,         // [T, K]
    const float* __restrict__ topk_weights,   // [T, K]
    void* __restrict__ out,                   // [T, H] bf16, or float32 when out_f32
    int out_f32, int tokens, int hidden, int inter, int experts, int top_k)
{
    __shared__ float rows[16][16];                                   // [slot][row]: the weighted dots
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, k = threadIdx.x >> 5;
    const int per_token = (hidden + 15) / 16;
    const int2 tb = pair_block(blockIdx.x, tokens, per_token);
    const int t = tb.x;
    const int h0 = tb.y * 16;
    const int e = __ldg(topk_ids + (long long)t * top_k + k);        // the routing: two kernels back
    const bool bad = (unsigned)e >= (unsigned)experts;
#if !DOWN_WAITS_LATE
    pdl_wait();     // the intermediate is gate_up's output: every read of it is an ld_dep after this
    pdl_release();
#endif
    bool waited = false;
    if (!bad) {
        const ARows a = w2_rows(w2, s2, e, min(h0 + g, hidden - 1), min(h0 + g + 8, hidden - 1), hidden, inter);
        const uint4* inter_row[1] = {
            reinterpret_cast<const uint4*>(intermediate + ((long long)t * top_k + k) * inter)};
        float acc[1][4];
        mma_rows_by_columns<DB_UNROLL, 1, true>(acc, a.lo, a.hi, a.scale_lo, a.scale_hi, inter_row, 0, inter / 8, q,
                                                waited);
        if (q == 0) {                                                // column 0: rows g, g + 8 of the pair
            const float weight = __ldg(topk_weights + (long long)t * top_k + k);
            rows[k][g] = __fmul_rn(weight, acc[0][0]);
            rows[k][g + 8] = __fmul_rn(weight, acc[0][2]);
        }
    }
    down_epilogue_wait();  // warps that never waited (a bad slot, or DB_EARLY_W2 off) before out is written
    __syncthreads();
    if (threadIdx.x < 16 && h0 + (int)threadIdx.x < hidden) {
        float v = 0.0f;
        bool token_bad = false;
        for (int s = 0; s < top_k; ++s) {                            // slot order, as moe_sum_slots
            token_bad |= (unsigned)__ldg(topk_ids + (long long)t * top_k + s) >= (unsigned)experts;
            v = __fadd_rn(v, rows[s][threadIdx.x]);
        }
        store_output(out, out_f32, (long long)t * hidden + h0 + threadIdx.x,
                     token_bad ? __int_as_float(0x7fc00000) : v);
    }
}
#endif  // PER_PAIR
#endif
"""

KERNELS = ("moe_expert_lists", "moe_gate_up_batched", "moe_down_batched")
MMA_KERNELS = ("moe_gate_up_mma", "moe_down_mma")  # compiled only with GB_MMA / DB_MMA 1
GROUPED_KERNELS = ("moe_down_grouped", "moe_sum_slots")  # compiled only with DB_GROUPED 1
PER_PAIR_KERNELS = ("moe_gate_up_pair", "moe_down_token")  # compiled only with PER_PAIR 1
