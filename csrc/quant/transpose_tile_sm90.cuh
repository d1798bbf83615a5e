// A 128 x 128 byte tile in shared memory written row by row and stored transposed to global memory,
// for the kernels that make a weight's transposed FP8 copy (quant/quantize_weight_sm90.cuh,
// quant/transpose_weight_sm90.cuh). 256 threads.
//
// Shared memory: row r (128 bytes, 8 pieces of 16) keeps its piece p at piece p ^ ((r / 16) % 8), so
// that the reads below, 32 lanes in 8 row blocks, meet 32 different banks.
//
// store_transposed_tile: lane l of warp w takes input rows 16 (l % 8) .. + 15 and input bytes
// 4 (4 w + l / 8) .. + 3: sixteen 4-byte reads, a 4 x 4 byte transpose of each four rows in registers
// (byte permutes), and four 16-byte stores, one per input byte column (an output row). For each store
// the 8 lanes of one l / 8 write one output row's 128 contiguous bytes: whole lines.
#pragma once

#include <cstdint>

namespace mok {

constexpr int kTransposeTileThreads = 256;
constexpr int kTransposeTileRowWords = 32;

// Whether the GEMM a weight copy is made for has rows of `expert` (always, without expert_offsets).
__device__ __forceinline__ bool expert_has_rows(const int32_t* expert_offsets, int64_t expert) {
  return expert_offsets == nullptr || __ldg(expert_offsets + expert) < __ldg(expert_offsets + expert + 1);
}

// The swizzled 16-byte piece of (row, piece) in the tile.
__device__ __forceinline__ int transpose_tile_piece(int row, int piece) { return piece ^ ((row / 16) % 8); }

// Four rows of four bytes -> four columns of four bytes: column j's byte i is row i's byte j.
__device__ __forceinline__ void transpose_4x4_bytes(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3,
                                                    uint32_t (&columns)[4]) {
  const uint32_t low01 = __byte_perm(r0, r1, 0x5140), low23 = __byte_perm(r2, r3, 0x5140);   // bytes 0, 1
  const uint32_t high01 = __byte_perm(r0, r1, 0x7362), high23 = __byte_perm(r2, r3, 0x7362);  // bytes 2, 3
  columns[0] = __byte_perm(low01, low23, 0x5410);
  columns[1] = __byte_perm(low01, low23, 0x7632);
  columns[2] = __byte_perm(high01, high23, 0x5410);
  columns[3] = __byte_perm(high01, high23, 0x7632);
}

// tile: the 128 x 128 bytes (swizzled as above) as 32-bit words; dst: output row 0's first byte (the
// tile's byte column 0 becomes dst's row 0), dst_row_bytes between output rows (16-byte aligned).
__device__ __forceinline__ void store_transposed_tile(const uint32_t* tile, uint8_t* dst, int64_t dst_row_bytes) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_block = lane % 8;
  const int word = 4 * warp + lane / 8;
  const int swizzled_word = word ^ (row_block << 2);  // transpose_tile_piece, in words
  uint32_t rows[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) rows[i] = tile[(16 * row_block + i) * kTransposeTileRowWords + swizzled_word];
  uint32_t columns[4][4];  // [byte column j][rows 4 g .. 4 g + 3]
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    uint32_t four[4];
    transpose_4x4_bytes(rows[4 * g], rows[4 * g + 1], rows[4 * g + 2], rows[4 * g + 3], four);
#pragma unroll
    for (int j = 0; j < 4; ++j) columns[j][g] = four[j];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *reinterpret_cast<uint4*>(dst + (4 * word + j) * dst_row_bytes + 16 * row_block) =
        make_uint4(columns[j][0], columns[j][1], columns[j][2], columns[j][3]);
  }
}

}  // namespace mok
