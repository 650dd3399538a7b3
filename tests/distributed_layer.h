// The layer the distributed tests compress: the same on every rank and in the test process.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "kvpress/distributed.h"
#include "kvpress/types.h"

namespace kvpress::testing {

// B = 1, Hkv = 4 (so 2 and 4 ranks divide it), Hq = 8, S = 96, D = 16; keys, values and the
// queries of every position, seeded. Head h's keys are scaled by 1 + h/2, so that presses setting
// budgets across heads (AdaKVPress over key norms) give the heads different ones.
inline LayerInputs distributed_layer(uint64_t seed = 7) {
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  LayerInputs in;
  in.keys = at::randn({1, 4, 96, 16}, generator) * (at::arange(4, at::kFloat) * 0.5 + 1).view({1, 4, 1, 1});
  in.values = at::randn({1, 4, 96, 16}, generator);
  in.queries = at::randn({1, 8, 96, 16}, generator);
  in.num_heads = 8;
  return in;
}

}  // namespace kvpress::testing
