// Skipping the tests of the AVX-512 kernels where they do not run.
#pragma once

#include <gtest/gtest.h>

#include "cpu/vector_clones.h"

// A test whose subject is an AVX-512 register-tile kernel (kernels/cpu/vector_clones.h) compares it
// with the ATen composite; where the kernel does not run, the op IS the composite, so the test skips
// with the reason instead of passing on the composite against itself.
#define KVPRESS_SKIP_UNLESS_AVX512_KERNELS()                                                                  \
  if (!kvpress::kernels::cpu_has_avx512())                                                                    \
  GTEST_SKIP() << "the AVX-512 kernels do not run in this process (no AVX-512F, a compiler without them, or " \
                  "KVPRESS_DISABLE_AVX512=1): the op is the composite it would be compared with"
