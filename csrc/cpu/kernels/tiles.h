// AMX's tile registers, as the amx tier's kernels use them (linear.h's bf16 matmuls): the process's permission to use
// them (any x86-64 library: the op library asks too) and the tiles' shapes (the amx tier alone).
//
// AMX (Intel Sapphire Rapids on) has 8 tile registers of up to 16 rows of 64 bytes and tdpbf16ps, which adds a tile A
// (M rows of 16 pairs of bf16) times a tile B (16 rows of pairs: row c holds, for each of 16 columns, its pair c) into
// a tile C (M rows of 16 floats). Each C element is a function of its own row of A and column of B alone, in an order
// of sums fixed by the instruction (not a float32 chain: the tier rounds as no other does), so a kernel that gives an
// output the same A row, B column and sequence of instructions wherever it is computed is row-independent.
#pragma once

#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>

namespace tr_engine_cpu {
namespace tiles {

// Asks Linux for this process's permission to use the tiles (their state is 8 KB a thread, handed out on request
// since Linux 5.16; without it the first tile instruction kills the process). The op library asks before it offers
// the amx tier (tiers.cpp, which includes this part alone: it needs no tier); the tier asks again when it is bound
// (tier.cpp), for any other host.
inline bool request() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace tiles
}  // namespace tr_engine_cpu
#endif

#if defined(TR_ENGINE_AMX)
#include "simd.h"

#include <cstdint>

namespace tr_engine_cpu {
namespace tiles {

// ldtilecfg's 64-byte operand: each tile's rows and bytes per row (0: unused).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  // Tile t as `rows` rows of 64 bytes.
  void shape(int t, int tile_rows) {
    rows[t] = static_cast<uint8_t>(tile_rows);
    colsb[t] = 64;
  }
  // Loads the shapes into this thread's tiles (which zeroes them). Every kernel loads its own before it uses them,
  // as another kernel (or oneDNN's) may have left others.
  void load() const { _tile_loadconfig(this); }
};

}  // namespace tiles
}  // namespace tr_engine_cpu
#endif
