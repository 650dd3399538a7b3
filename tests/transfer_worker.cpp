// One worker of the prefill -> decode transfer tests (tests/test_distributed.cpp starts two):
//
//   kvpress_transfer_worker STORE RANK SCENARIO PRESS RATIO OUT
//
// rank 0, the prefill worker: prefills testing::transfer_prompt() on tinystories-656k into its
//   PagedKVCache (pages of 16 tokens), compressed by PRESS at RATIO ("none": every token), picks
//   the first token from the prefill's logits, sends the sequence with it to rank 1 and frees it;
//   writes its TransferStats (tokens, kv_bytes, position_bytes, header_bytes as int64) to OUT.
// rank 1, the decode worker: receives the sequence into its own cache (pages of 8 tokens), decodes
//   greedily until it has kTransferNewTokens tokens; writes them (int64), then its TransferStats.
// Scenarios: transfer (the above; exit 0); sender_dies (rank 0 leaves before sending: rank 1 must
// raise at the preamble, exit 4); small_pool (rank 1's pool holds 2 pages per layer: rank 1 must
// raise and rank 0 learn that it refused; both exit 3). An unexpected error prints it and exits 1.
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "distributed_layer.h"
#include "kvpress/distributed.h"
#include "kvpress/llama/llama.h"
#include "kvpress/registry.h"
#include "tiny_model.h"

namespace {

using namespace kvpress;  // NOLINT(google-build-using-namespace)

void write_values(std::FILE* out, const std::vector<int64_t>& values) {
  std::fwrite(values.data(), sizeof(int64_t), values.size(), out);
}
std::vector<int64_t> stats_values(const distributed::TransferStats& s) {
  return {s.tokens, s.kv_bytes, s.position_bytes, s.header_bytes};
}

int64_t greedy_token(const at::Tensor& logits) { return logits.argmax().item<int64_t>(); }

void prefill_and_send(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const llama::LlamaModel& model,
                      const BasePress* press, std::FILE* out) {
  PagedKVCache cache = model.new_paged_cache(64, 16);
  const SequenceId seq = cache.add_sequence();
  llama::PagedPrefillOptions options;
  options.press = press;
  const at::Tensor logits = model.prefill_paged({testing::transfer_prompt()}, {seq}, cache, options);
  const distributed::TransferStats sent = distributed::send_sequence(group, 1, cache, seq, {greedy_token(logits[0])});
  cache.free_sequence(seq);
  write_values(out, stats_values(sent));
}

void receive_and_decode(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const llama::LlamaModel& model,
                        int64_t pages_per_layer, std::FILE* out) {
  PagedKVCache cache = model.new_paged_cache(pages_per_layer, 8);
  const distributed::ReceivedSequence received = distributed::receive_sequence(group, 0, cache);
  TORCH_CHECK(received.token_ids.size() == 1, "the prefill worker sends one token, got ", received.token_ids.size());
  std::vector<int64_t> tokens = received.token_ids;
  while (static_cast<int64_t>(tokens.size()) < testing::kTransferNewTokens)
    tokens.push_back(greedy_token(model.decode_paged({received.seq}, {tokens.back()}, cache)[0]));
  write_values(out, tokens);
  write_values(out, stats_values(received.stats));
}

int run(int argc, char** argv) {
  TORCH_CHECK(argc == 7, "usage: kvpress_transfer_worker STORE RANK SCENARIO PRESS RATIO OUT");
  const std::string store = argv[1], scenario = argv[3], press_name = argv[4], out_path = argv[6];
  const int rank = std::stoi(argv[2]);
  auto group = distributed::gloo_group(store, rank, 2, std::chrono::milliseconds(5000));
  if (scenario == "sender_dies" && rank == 0) std::_Exit(0);
  const llama::LlamaModel& model = testing::tiny_model();
  const std::shared_ptr<const BasePress> press =
      press_name == "none" ? nullptr : make_press(press_name, std::stod(argv[5]));
  std::FILE* out = std::fopen(out_path.c_str(), "wb");
  TORCH_CHECK(out != nullptr, "cannot write ", out_path);
  try {
    if (rank == 0)
      prefill_and_send(group, model, press.get(), out);
    else
      receive_and_decode(group, model, scenario == "small_pool" ? 2 : 128, out);
  } catch (const c10::Error& e) {
    std::fclose(out);
    const std::string what = e.what_without_backtrace();
    std::cerr << "rank " << rank << ": " << what << "\n";
    if (scenario == "sender_dies" && what.find("receive_sequence: rank 0 to rank 1: the preamble failed") == 0)
      return 4;
    if (scenario == "small_pool" && rank == 0 && what.find("the receiver refused sequence") != std::string::npos)
      return 3;
    if (scenario == "small_pool" && rank == 1 && what.find("out of pages at layer 0") != std::string::npos) return 3;
    return 1;
  }
  return std::fclose(out) == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "kvpress_transfer_worker: " << c10::GetExceptionString(e) << "\n";
    return 1;
  }
}
