/*
 * gpu_kernel — the gather/scatter kernel: copies plan units between any
 * two layouts, reading or writing peer GPU memory (NVLink/PCIe P2P) or
 * mapped host memory. Rows are head_dim * elem_size bytes and move as
 * 16-byte vectors when every address and stride is 16-byte aligned, else
 * as bytes. Any CTA budget works; the budget is the caller's, since the
 * GPUs are busy running the model.
 *
 * With few CTAs a copy is bound by the bytes each SM keeps in flight, so
 * every warp keeps loads in flight nearly all the time: each lane issues
 * UNROLL 16-byte copies into shared memory (cp.async: 128 KiB a CTA,
 * more than registers could hold) before it stores any, and the next
 * piece's work (its number, its unit's tables) is fetched between the
 * loads and the stores of the current piece's last batch, where its
 * latency hides under theirs. What a piece costs besides its bytes is a
 * few integer operations per vector (gpu_walk.h: no division, no table
 * walk); the launch's cut is made on the host.
 *
 * Work is handed out dynamically: a launch's units are cut into pieces of
 * about GPU_PIECE_BYTES (a part of a long unit, or a few short units),
 * and each warp takes the next piece from a counter in device memory, so
 * all warps finish together and the next launch on the stream waits for
 * no straggler. The counter is reset by the last warp of the launch; the
 * launches of one device are serialized on its stream (gpu.c), so one
 * counter per device serves them all (a faulted kernel leaves it dirty,
 * but a fault also ends the context).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "gpu_desc.h"
#include "gpu_walk.h"

/* UNROLL 16-byte loads in flight per lane. STAGE 1: they land in shared
 * memory (cp.async), UNROLL * THREADS * 16 bytes a CTA, which holds more
 * bytes in flight than registers can; STAGE 0: in registers. On one H200
 * (docs/history/benchmarks.md, issue 20), 512 threads staging 16 a lane did 680
 * GB/s at 16 CTAs and 1733 at 64; 8 a lane in registers 650 and 1696,
 * 256 threads with 16 in registers 530 and 1538, 24 a lane staged (192
 * KiB) 543 and 1400. Overridable with -D for measurements. */
#ifndef THREADS
#define THREADS 512
#endif
#ifndef STAGE
#define STAGE 1
#endif
#ifndef UNROLL
#define UNROLL (STAGE ? 16 : 8)
#endif
#define STAGE_BYTES (STAGE ? UNROLL * THREADS * 16 : 0)

__device__ static unsigned long long next_piece; /* of the running launch */
__device__ static unsigned int warps_done;

/* Streaming accesses: each byte is read once and written once, so
 * neither side should displace what the model keeps in L1 and L2. The
 * source is read-only for the kernel's life (the non-coherent path). */
template <typename T> struct acc;

template <> struct acc<uint4> {
    static __device__ __forceinline__ uint4 load(const uint8_t *p)
    {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
        return v;
    }
    static __device__ __forceinline__ void store(uint8_t *p, uint4 v)
    {
        __stcs((uint4 *)p, v);
    }
};

template <> struct acc<uint8_t> {
    static __device__ __forceinline__ uint8_t load(const uint8_t *p)
    {
        return __ldg(p);
    }
    static __device__ __forceinline__ void store(uint8_t *p, uint8_t v)
    {
        *p = v;
    }
};

/* Copy elements [lo, hi) of unit x, the whole warp together: lane l takes
 * elements lo + l + 32 i, U of them loaded before any is stored.
 * mid() runs once, warp-uniformly, between the last batch's loads and
 * its stores (or at once when there is no batch): there the item's own
 * indices are dead, which leaves mid() the registers it needs. Where
 * every lane's batch lies inside one run (long runs: 32 KiB for
 * matching layouts), its addresses are a base and a constant step;
 * elsewhere the cursor steps element by element. */
template <typename T, int U, typename F>
__device__ __forceinline__ void item_copy(const gpu_unit_t &x, uint32_t lo,
                                          uint32_t hi, unsigned lane, F &mid)
{
    constexpr uint32_t STEP = 32 * sizeof(T); /* bytes between a lane's */
    const uint32_t n = hi - lo;
    const uint32_t steps = (n + 31) / 32; /* lane 0's: the most */
    const uint32_t mine = n > lane ? (n - lane + 31) / 32 : 0;
    if (!steps) {
        mid();
        return;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)x.src;
    uint8_t *dst = (uint8_t *)(uintptr_t)x.dst;
    gpu_cur_t c;
    gpu_cur_init(&x, lo + lane, &c);
    for (uint32_t s0 = 0;; s0 += U) {
        const bool last = s0 + U >= steps;
        T v[U];
        if (__all_sync(0xffffffffu, c.col + 32u * (U - 1) < x.er)) {
            const uint8_t *from = src + c.so;
            uint8_t *to = dst + c.dof;
#pragma unroll
            for (int k = 0; k < U; k++)
                if (s0 + k < mine)
                    v[k] = acc<T>::load(from + k * STEP);
            if (last)
                mid();
#pragma unroll
            for (int k = 0; k < U; k++)
                if (s0 + k < mine)
                    acc<T>::store(to + k * STEP, v[k]);
            if (last)
                return;
            c.col += 32u * (U - 1);
            c.so += (U - 1) * STEP;
            c.dof += (U - 1) * STEP;
            gpu_cur_step(&x, &c);
            continue;
        }
        uint64_t to[U];
#pragma unroll
        for (int k = 0; k < U; k++)
            if (s0 + k < mine) {
                v[k] = acc<T>::load(src + c.so);
                to[k] = c.dof;
                gpu_cur_step(&x, &c);
            }
        if (last)
            mid();
#pragma unroll
        for (int k = 0; k < U; k++)
            if (s0 + k < mine)
                acc<T>::store(dst + to[k], v[k]);
        if (last)
            return;
    }
}

#if STAGE
/* Vectors through shared memory: the lane's k-th of a batch lands in
 * stage slot k * THREADS + threadIdx.x, and only that lane reads it back,
 * after its own cp.async.wait_group (no barrier); it reads it before it
 * issues the next batch's copies (the store waits for the read), so no
 * copy overwrites a slot still to be read. */
__device__ __forceinline__ void stage_load(uint32_t slot, const uint8_t *p)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(slot), "l"(p)
                 : "memory");
}

__device__ __forceinline__ void stage_wait(void)
{
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::
                     : "memory");
}

/* item_copy() for 16-byte vectors, through the stage: the same walk, mid()
 * at the same place, UNROLL copies in flight per lane without registers
 * to hold them. */
template <typename F>
__device__ __forceinline__ void
item_copy_staged(const gpu_unit_t &x, uint32_t lo, uint32_t hi, unsigned lane,
                 uint32_t stage, const uint4 *slots, F &mid)
{
    constexpr uint32_t STEP = 32 * 16;      /* bytes between a lane's */
    constexpr uint32_t SLOT = THREADS * 16; /* between its slots */
    const uint32_t n = hi - lo;
    const uint32_t steps = (n + 31) / 32; /* lane 0's: the most */
    const uint32_t mine = n > lane ? (n - lane + 31) / 32 : 0;
    if (!steps) {
        mid();
        return;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)x.src;
    uint8_t *dst = (uint8_t *)(uintptr_t)x.dst;
    gpu_cur_t c;
    gpu_cur_init(&x, lo + lane, &c);
    for (uint32_t s0 = 0;; s0 += UNROLL) {
        const bool last = s0 + UNROLL >= steps;
        if (__all_sync(0xffffffffu, c.col + 32u * (UNROLL - 1) < x.er)) {
            const uint8_t *from = src + c.so;
            uint8_t *to = dst + c.dof;
#pragma unroll
            for (int k = 0; k < UNROLL; k++)
                if (s0 + k < mine)
                    stage_load(stage + k * SLOT, from + k * STEP);
            if (last)
                mid();
            stage_wait();
#pragma unroll
            for (int k = 0; k < UNROLL; k++)
                if (s0 + k < mine)
                    acc<uint4>::store(to + k * STEP, slots[k * THREADS]);
            if (last)
                return;
            c.col += 32u * (UNROLL - 1);
            c.so += (UNROLL - 1) * STEP;
            c.dof += (UNROLL - 1) * STEP;
            gpu_cur_step(&x, &c);
            continue;
        }
        gpu_cur_t c0 = c;
#pragma unroll
        for (int k = 0; k < UNROLL; k++)
            if (s0 + k < mine) {
                stage_load(stage + k * SLOT, src + c.so);
                gpu_cur_step(&x, &c);
            }
        if (last)
            mid();
        stage_wait();
#pragma unroll
        for (int k = 0; k < UNROLL; k++)
            if (s0 + k < mine) {
                acc<uint4>::store(dst + c0.dof, slots[k * THREADS]);
                gpu_cur_step(&x, &c0);
            }
        if (last)
            return;
    }
}
#endif

/* The next item of a warp, resolved while its current one copies: kept
 * in shared memory, not in registers, which the current item's loads
 * need. */
struct next_item {
    gpu_unit_t x;
    uint32_t lo, hi;
    int have;
};

__global__ void __launch_bounds__(THREADS, 1)
    kvx_copy_kernel(const gpu_plan_t p, const gpu_launch_t l)
{
    __shared__ next_item nexts[THREADS / 32];
    const unsigned lane = threadIdx.x & 31;
    next_item &slot = nexts[threadIdx.x >> 5];
    const uint64_t warp = (blockIdx.x * (uint64_t)THREADS + threadIdx.x) >> 5;
    const uint64_t nwarps = (uint64_t)gridDim.x * (THREADS / 32);
    uint32_t hint = gpu_slice_find(&p, l.u0);
    uint64_t poff0 = 0;
    if (l.packed_mode != GPU_PACKED_NONE)
        poff0 = gpu_packed_off(&p, &p.slices[hint], l.u0);
    /* piece t, its unit j: the first piece is the warp's own, the rest
     * come from the counter, each ticket taken a piece ahead; a ticket
     * is taken only while pieces are left, and every one taken is
     * read, so none is still in flight when the warp counts itself
     * done */
    uint64_t t = warp;
    uint32_t j = 0;
    unsigned long long ticket = 0;
    gpu_unit_t x;
    uint32_t lo = 0, hi = 0;
    bool have = t < l.npieces;
    if (have) {
        if (lane == 0)
            ticket = atomicAdd(&next_piece, 1ull);
        gpu_item_t it;
        gpu_item_get(&p, &l, &hint, poff0, t, 0, &it);
        x = it.x;
        lo = it.lo;
        hi = it.hi;
    }
    auto mid = [&]() {
        if (j + 1 < gpu_piece_units(&l, t)) {
            j++;
        } else {
            t = nwarps + __shfl_sync(0xffffffffu, ticket, 0);
            j = 0;
            if (t < l.npieces && lane == 0)
                ticket = atomicAdd(&next_piece, 1ull);
        }
        slot.have = t < l.npieces;
        if (slot.have) {
            gpu_item_t n;
            gpu_item_get(&p, &l, &hint, poff0, t, j, &n);
            slot.x = n.x;
            slot.lo = n.lo;
            slot.hi = n.hi;
        }
    };
#if STAGE
    extern __shared__ uint4 stage_mem[]; /* STAGE_BYTES */
    const uint4 *mine = stage_mem + threadIdx.x;
    const uint32_t stage = (uint32_t)__cvta_generic_to_shared(mine);
#endif
    while (have) {
        if (x.eshift == 4)
#if STAGE
            item_copy_staged(x, lo, hi, lane, stage, mine, mid);
#else
            item_copy<uint4, UNROLL>(x, lo, hi, lane, mid);
#endif
        else
            item_copy<uint8_t, 8>(x, lo, hi, lane, mid);
        __syncwarp(); /* every lane wrote the same slot */
        have = slot.have;
        if (have) {
            x = slot.x;
            lo = slot.lo;
            hi = slot.hi;
        }
        __syncwarp(); /* read before the next mid() writes it */
    }
    __threadfence(); /* this warp's tickets are taken before it counts */
    if (lane == 0) {
        if (atomicAdd(&warps_done, 1u) == nwarps - 1) {
            /* every warp has taken its last ticket: reset for the next
             * launch, which the stream starts after this one ends */
            atomicExch(&next_piece, 0ull);
            atomicExch(&warps_done, 0u);
        }
    }
}

extern "C" int gpu_kernel_launch(const gpu_plan_t *d, gpu_launch_t *l,
                                 uint64_t bytes, unsigned ctas, void *stream)
{
    if (l->u1 <= l->u0)
        return 0;
    gpu_launch_cut(l, bytes, (uint64_t)ctas * (THREADS / 32));
    /* an error an earlier call left on this thread (a failed allocation)
     * must not pass for this launch's: clear it, launch, then ask */
    (void)cudaGetLastError();
#if STAGE
    /* more than 48 KiB of shared memory is granted per device, once
     * (launches come from the loop thread alone) */
    static uint8_t stage_ok[64];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess && dev < 64 && !stage_ok[dev]) {
        e = cudaFuncSetAttribute(kvx_copy_kernel,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 STAGE_BYTES);
        stage_ok[dev] = e == cudaSuccess;
    }
    if (e != cudaSuccess)
        return (int)e;
#endif
    kvx_copy_kernel<<<ctas, THREADS, STAGE_BYTES, (cudaStream_t)stream>>>(*d,
                                                                          *l);
    return (int)cudaGetLastError();
}
