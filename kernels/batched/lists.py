"""The routing lists every batched family starts from: ``moe_expert_lists`` and the layout of its buffer.

One block turns ``topk_ids`` into the batch's active experts (ascending id), each one's offset and count into a list
of pairs (pair = t*K + k) sorted by expert, stable by pair index, and -- for the tensor-core family (``PAIR_TILES``)
-- a tile table cutting every expert's pairs into runs of ``TILE_PAIRS`` (one gate_up pass). Deterministic
(warp-parallel ranks with ``__match_any_sync``, exclusive prefixes over the warps), no atomics, in shared memory.
Out-of-range ids go to one extra pseudo-expert slot (E) whose pairs get NaN downstream.

A family that uses the lists puts :data:`CODE` in its source (after the shared helpers) and sets
its derived macros (``LIST_THREADS``, ``LIST_PER``: :func:`list_rules`); it defines ``PAIR_TILES`` and
``TILE_PAIRS``. The host side here sizes the buffer and
the kernel's shared memory and launches it (:func:`lists_stage`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernels.compile import launch_ex
from kernels.contract import Dims

LIST_HEADER = 4  # int32s before the slot arrays in the lists buffer (must match LIST_HEADER in the CUDA C)
TILE_ARRAYS = 4  # the tile table's arrays: expert, first pair, pairs, place in the expert's run of tiles
SHARED_LIMIT = 48 * 1024  # dynamic shared memory without opt-in
OPT_IN_SHARED_LIMIT = 227 * 1024  # what a kernel may opt into above 48 KB (sm_90; the launches set it)
# threads of the one-block list kernel (32..1024 swept within 0.3 %: results/sweep-2026-12-01-list-threads-*.json)
LIST_THREADS = 256
LIST_PER_LIMIT = 16  # experts (+1 pseudo expert) per list thread: (E + 1) <= LIST_THREADS * LIST_PER


def slots(dims: Dims) -> int:
    """List slots: every active expert (<= min(E, T*K)) plus one for out-of-range ids."""
    return min(dims.experts, dims.tokens * dims.top_k) + 1


def tile_capacity(dims: Dims, tile_pairs: int = 8) -> int:
    """Tiles of ``tile_pairs`` pairs the batch's slots can need at most: sum of ceil(count / tile) over the
    slots <= T*K // tile + slots. The tile table is sized for 8 (the smallest tile)."""
    return slots(dims) + dims.tokens * dims.top_k // tile_pairs


def lists_size(dims: Dims) -> int:
    """int32s of the lists buffer: header, expert / offset / count per slot, the sorted pairs, the tile table
    (expert / first / count / place in its expert's run per tile, written with PAIR_TILES)."""
    return LIST_HEADER + 3 * slots(dims) + dims.tokens * dims.top_k + TILE_ARRAYS * tile_capacity(dims)


def lists_shared_bytes(dims: Dims, params: dict[str, int]) -> int:
    """Dynamic shared memory of the list kernel: one int per expert (+1 for bad ids) and per warp's count table
    of them, two per pair (its expert and its rank)."""
    warps = params["LIST_THREADS"] // 32
    return ((dims.experts + 1) * (1 + warps) + 2 * dims.tokens * dims.top_k) * 4


def list_rules(dims: Dims | None, values: dict[str, int]) -> None:
    """LIST_THREADS and LIST_PER (derived) from ``dims``; ValueError where the list kernel cannot cover E or its
    shared memory."""
    values["LIST_THREADS"] = LIST_THREADS
    if dims is None:
        values["LIST_PER"] = 1
        return
    values["LIST_PER"] = -(-(dims.experts + 1) // values["LIST_THREADS"])
    if values["LIST_PER"] > LIST_PER_LIMIT:
        raise ValueError(f"the list kernel covers E + 1 <= {LIST_THREADS * LIST_PER_LIMIT} experts (its "
                         f"{LIST_THREADS} threads x {LIST_PER_LIMIT}), got E = {dims.experts}")
    if lists_shared_bytes(dims, values) > OPT_IN_SHARED_LIMIT:
        raise ValueError(
            f"the list kernel keeps (1 + LIST_THREADS / 32) ints per expert and two per pair in shared memory: "
            f"E = {dims.experts} and T * K = {dims.tokens * dims.top_k} need {lists_shared_bytes(dims, values)} "
            f"bytes > {OPT_IN_SHARED_LIMIT}")


def opt_in_shared(kernel: Any, shared: int) -> None:
    """Let ``kernel`` take ``shared`` bytes of dynamic shared memory (above 48 KB it must opt in, once)."""
    if shared > SHARED_LIMIT and kernel.max_dynamic_shared_size_bytes < shared:
        kernel.max_dynamic_shared_size_bytes = shared


def lists_stage(kernel: Any, dims: Dims, params: dict[str, int], topk_ids: Any, lists: Any) -> Any:
    """The list kernel's launch as a zero-argument callable (its shared memory opted into here, once)."""
    shared = lists_shared_bytes(dims, params)
    opt_in_shared(kernel, shared)
    args = (topk_ids, np.int32(dims.tokens * dims.top_k), np.int32(dims.experts), np.int32(slots(dims)), lists)

    def expert_lists() -> None:
        launch_ex(kernel, (1,), (params["LIST_THREADS"],), args, shared_mem=shared, programmatic=bool(params["PDL"]))

    return expert_lists


KERNEL = "moe_expert_lists"
CODE = r"""
// ==== the routing lists (kernels/batched/lists.py) ====
static_assert(LIST_THREADS >= 32 && LIST_THREADS <= 1024 && LIST_THREADS % 32 == 0, "LIST_THREADS: 32..1024, x32");
static_assert(LIST_PER >= 1 && LIST_PER <= 16, "LIST_PER must be 1..16");
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
"""
