// The stage ring of the sm90 pipelines: kStages shared-memory stages, each with a `full` barrier
// (the producer's loads landed) and an `empty` barrier (every consumer released it).
#pragma once

#include <cstdint>

namespace mok::sm90 {

// The next use of a ring of kStages pipeline stages: the stage index, and the parity its barriers
// complete with (it flips each time the ring wraps).
template <int kStages>
__device__ __forceinline__ void advance_stage(int& stage, uint32_t& phase) {
  if (++stage == kStages) {
    stage = 0;
    phase ^= 1;
  }
}

}  // namespace mok::sm90
