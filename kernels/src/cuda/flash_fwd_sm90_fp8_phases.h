// The phases a stamped build of the FP8 forward kernel times (traits with kStamps, built only by
// kernels/bench/fp8_variants): SM clocks summed per phase over the key tiles of each consumer
// warpgroup's thread 0 and of the producer thread, to tell which wait bounds a tile.
#pragma once

namespace attn::kernels::cuda {

enum Sm90Fp8Phase : int {
  kFp8WaitQ,      // consumer: Q's tile loaded
  kFp8WaitK,      // consumer: the key tile's K loaded
  kFp8S,          // consumer: S = Q K^T issued and complete
  kFp8Softmax,    // consumer: mask and softmax of S
  kFp8Pack,       // consumer: O rescaled, P packed to e4m3
  kFp8WaitV,      // consumer: the key tile's Vt loaded
  kFp8Pv,         // consumer: O += P V issued and complete, the stage released
  kFp8Epilogue,   // consumer: O normalised and stored
  kFp8WaitEmpty,  // producer: a ring stage freed by the consumers (K's and V's)
  kFp8Issue,      // producer: the TMA loads issued
  kFp8Phases,
};

// Slots of the stamped build's counters: the phases, then the consumers' key tiles and the
// producer's.
constexpr int kFp8ConsumerTilesSlot = kFp8Phases;
constexpr int kFp8ProducerTilesSlot = kFp8Phases + 1;
constexpr int kFp8PhaseSlots = kFp8Phases + 2;

// The timeline of one CTA's first Q tile: per role (the consumer warpgroups, then the producer),
// up to kFp8TraceMarks (phase, SM clock) pairs, phase kFp8Phases marking the role's start.
constexpr int kFp8TraceRoles = 4;
constexpr int kFp8TraceMarks = 128;

}  // namespace attn::kernels::cuda
