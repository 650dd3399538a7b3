// Skipping the tests of the register-tile kernels where they do not run.
#pragma once

#include <gtest/gtest.h>

#include "cpu/vector_clones.h"

// A test whose subject is a register-tile kernel (src/ops/cpu/register_tile.h, compiled for AVX-512
// and for AVX2 + FMA) compares it with the ATen composite; where no tile runs, the op IS the
// composite, so the test skips with the reason instead of passing on the composite against itself.
// Where one runs, the test checks the tiles of that ISA (the AVX2 ones on an AVX-512 machine in
// scripts/test_avx2_path.sh's pass).
#define KVPRESS_SKIP_UNLESS_TILE_KERNELS()                                                                      \
  if (kvpress::kernels::cpu_tile_isa() == kvpress::kernels::TileIsa::kNone)                                     \
  GTEST_SKIP() << "no register-tile kernels run in this process (a CPU without AVX2 + FMA, a compiler without " \
                  "them, or KVPRESS_DISABLE_AVX2=1): the op is the composite it would be compared with"
