// AMX tile state shared by the kernels that use the tile unit (small_linear.cpp,
// prefill_attention.cpp): the per-process permission and one configuration, every tile
// 16 rows x 64 bytes. Empty unless compiled with AMX-TILE.
#pragma once

#if defined(__AMX_TILE__)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pdserve {
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool permitted() {
  // Linux hands out AMX state per process on request (XFEATURE_XTILEDATA = 18).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return ok;
}

inline void load_tile_config() {  // all 8 tiles: 16 rows x 64 bytes
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace amx
}  // namespace pdserve

#endif  // __AMX_TILE__
