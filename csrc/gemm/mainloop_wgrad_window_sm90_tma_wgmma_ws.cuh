// The windowed weight gradient's mainloop (sm90, TMA + wgmma, warp-specialized): the weight
// gradient's mainloop (gemm/mainloop_wgrad_sm90_tma_wgmma_ws.cuh) over one window of the schedule's
// rows, with the K chain of an expert that crosses a window boundary carried through global memory
// in fp32 (mok_params.h ExpertWgradWindowProblem, WgradCarryParams).
//
// A tile's K loop is the chain acc = wgmma(A_kb, B_kb, acc) over its segment's 64-row K blocks.
// When a window boundary falls on a K-block boundary of the segment, stopping the chain there,
// storing the fp32 accumulators and loading them back before the next block is exact: the next
// window's first wgmma accumulates onto the same bits (scale-d 1) that the whole-schedule kernel
// would hold in registers at that point. So the windows' out equals the whole-schedule kernel's bit
// for bit. The producer checks, per carried tile, that the boundaries lie on K blocks and that the
// carry buffers are there; a failed check is recorded (the watchdog names it) and traps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/failure_codes.h"
#include "common/watchdog_sm90.cuh"
#include "gemm/mainloop_wgrad_sm90_tma_wgmma_ws.cuh"
#include "gemm/tile_scheduler_sm90.cuh"
#include "gemm/tile_sm90.cuh"
#include "mok_params.h"

namespace mok {

class WgradWindowMainloop : public WgradMainloop {
 public:
  static constexpr bool kCarriesAccumulators = true;
  // A carry buffer's floats per tile: 256 consumer threads x 128 accumulators.
  static constexpr int kCarryFloatsPerTile = Tile::kConsumerThreads * Tile::kAccumulators;
  static_assert(kCarryFloatsPerTile == Tile::kM * Tile::kN, "a carried tile holds one fp32 per output element");

  struct ConsumerTile : WgradMainloop::ConsumerTile {
    bool carry_in, carry_out;
    int carry_tile;
  };

  template <class Params>
  __device__ explicit WgradWindowMainloop(const Params& p) : WgradMainloop(p), carry_(p.carry) {}

  // ---- producer (one thread) ----

  // A carried tile's checks, before its first load: its window boundaries lie on the segment's K
  // blocks (else the split chain would not be the whole one), and its carry buffer exists. On a
  // failure the producer loads nothing more, so the consumers, waiting for the tile's first stage,
  // write nothing of it before the watchdog traps.
  template <class Params>
  __device__ __forceinline__ Loads producer_tile(const Params& p, const WgradWindowTileCoord& c, int, ProducerState&,
                                                 sm90::WaitWatch* watch) const {
    if (c.carry_in || c.carry_out) {
      const bool in_misaligned = c.carry_in && c.segment_begin % Tile::kK != 0;
      const bool out_misaligned = c.carry_out && (p.problem.num_rows - c.segment_begin) % Tile::kK != 0;
      if (in_misaligned || out_misaligned) sm90::fail_check(kCheckCarryKBlockAlignment, watch);
      if (c.carry_in && carry_.in == nullptr) sm90::fail_check(kCheckCarryInBuffer, watch);
      if (c.carry_out && carry_.out == nullptr) sm90::fail_check(kCheckCarryOutBuffer, watch);
    }
    return Loads{};
  }

  // ---- consumers ----

  __device__ __forceinline__ ConsumerTile consumer_tile(const WgradWindowTileCoord& c) const {
    ConsumerTile t;
    static_cast<WgradMainloop::ConsumerTile&>(t) = WgradMainloop::consumer_tile(c);
    t.carry_in = c.carry_in;
    t.carry_out = c.carry_out;
    t.carry_tile = c.carry_tile;
    return t;
  }

  // A carried-in chain accumulates from its first wgmma on.
  __device__ __forceinline__ void mma(Tile::Accumulators& acc, const ConsumerTile& t, int kb, uint8_t* a,
                                      uint8_t* b) const {
    mma_k_block(acc, a, b, kb != 0 || t.carry_in);
  }

  // Before the tile's first K block (acc is zeros): a carried-in chain's accumulators, as the
  // previous window left them. (A null carry_in is never read: the producer has stopped at this
  // tile's check.)
  __device__ __forceinline__ void resume_accumulators(Tile::Accumulators& acc, const ConsumerTile& t, int consumer,
                                                      int thread) const {
    const bool load = t.carry_in && carry_.in != nullptr;
    const float4* from = reinterpret_cast<const float4*>(carry_.in) + carry_chunk(t, consumer, thread);
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators / 4; ++i) {
      load_chunk_if(load, from + i * Tile::kConsumerThreads, acc, 4 * i);
    }
  }

  // After the tile's last K block: true when its chain goes on in the next window, with the
  // accumulators stored to carry_out in its place of out. (carry_out is not null here: the
  // producer checked it before loading this tile's first stage, which the consumers waited for.)
  __device__ __forceinline__ bool suspend_accumulators(const Tile::Accumulators& acc, const ConsumerTile& t,
                                                       int consumer, int thread) const {
    if (!t.carry_out) return false;
    float4* to = reinterpret_cast<float4*>(carry_.out) + carry_chunk(t, consumer, thread);
#pragma unroll
    for (int i = 0; i < Tile::kAccumulators / 4; ++i) {
      to[i * Tile::kConsumerThreads] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
    }
    return true;
  }

 private:
  // acc[first, first + 4) = *from where `load`, unchanged elsewhere: one predicated load. (Under a
  // branch, the loads defining accumulators on one path only made ptxas serialize every wgmma of
  // the kernel, C7515.) from: read-only during the kernel (carry_in is never carry_out).
  static __device__ __forceinline__ void load_chunk_if(bool load, const float4* from, Tile::Accumulators& acc,
                                                       int first) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %4, 0;\n"
        "@p ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%5];\n"
        "}\n"
        : "+f"(acc[first]), "+f"(acc[first + 1]), "+f"(acc[first + 2]), "+f"(acc[first + 3])
        : "r"(int(load)), "l"(from));
  }

  // This thread's first 16-byte chunk of the tile in a carry buffer, counted in chunks (layout:
  // mok_params.h WgradCarryParams); chunk i is 256 chunks further.
  static __device__ __forceinline__ int64_t carry_chunk(const ConsumerTile& t, int consumer, int thread) {
    return int64_t(t.carry_tile) * (kCarryFloatsPerTile / 4) + (kNumThreadsPerWarpGroup * consumer + thread);
  }

  WgradCarryParams carry_;
};

}  // namespace mok
