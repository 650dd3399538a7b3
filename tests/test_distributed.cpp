// kvpress::distributed over Gloo with 2 and 4 ranks as separate processes on loopback
// (tests/distributed_worker.cpp): each rank's per-rank compression equals compressing its heads
// alone in this process, its global compression equals what compressing the whole layer here keeps
// of its heads, a configuration that differs across ranks is refused on every rank, and a rank that
// leaves (before the setup or between the setup and a layer) makes the others fail with an error
// instead of waiting. tests/test_head_span.cpp runs every press in global mode (ranks as threads).
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distributed_layer.h"
#include "kvpress/distributed.h"
#include "kvpress/llama/llama.h"
#include "kvpress/presses/knorm_press.h"
#include "kvpress/registry.h"
#include "test_util.h"
#include "tiny_model.h"

extern char** environ;

namespace kvpress {
namespace {

struct RankRun {
  std::vector<int> exit_codes;
  std::vector<std::string> outputs;                        // each rank's OUT file
  std::vector<double> seconds;                             // when each rank had finished, from the start
  std::shared_ptr<const testing::TemporaryFolder> folder;  // holds the outputs, removed with the last copy
};

// Starts `world` processes, rank r with the command line args(r, store, out) for the group's file
// store and its OUT file, and waits for them all (killing them after 60 s: a hang is a failure,
// never a stuck suite).
using WorkerArgs = std::function<std::vector<std::string>(int rank, const std::string& store, const std::string& out)>;
RankRun run_processes(int world, const std::string& label, const WorkerArgs& args_of) {
  RankRun run;
  run.folder = std::make_shared<const testing::TemporaryFolder>("kvpress_dist_" + label);
  const std::string store = run.folder->file("store");
  std::vector<pid_t> pids;
  const auto start = std::chrono::steady_clock::now();
  for (int rank = 0; rank < world; ++rank) {
    run.outputs.push_back(run.folder->file("rank" + std::to_string(rank)));
    std::vector<std::string> args = args_of(rank, store, run.outputs.back());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0) << argv[0];
    pids.push_back(pid);
  }
  run.exit_codes.assign(pids.size(), -1);
  run.seconds.assign(pids.size(), 0.0);
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    while (waitpid(pids[i], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
        for (pid_t p : pids) ::kill(p, SIGKILL);
        waitpid(pids[i], &status, 0);
        ADD_FAILURE() << "rank " << i << " of " << label << " did not finish in 60 s";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    run.exit_codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return run;
}

// `world` ranks of tests/distributed_worker.cpp in `scenario`.
RankRun run_ranks(int world, const std::string& scenario, const std::string& press, double ratio) {
  return run_processes(world, scenario, [&](int rank, const std::string& store, const std::string& out) {
    return std::vector<std::string>{KVPRESS_DISTRIBUTED_WORKER, store,    std::to_string(rank),
                                    std::to_string(world),      scenario, press,
                                    std::to_string(ratio),      out};
  });
}

// The prefill worker (rank 0) and the decode worker (rank 1) of tests/transfer_worker.cpp.
RankRun run_transfer(const std::string& scenario, const std::string& press, double ratio) {
  return run_processes(2, "transfer_" + scenario, [&](int rank, const std::string& store, const std::string& out) {
    return std::vector<std::string>{KVPRESS_TRANSFER_WORKER, store, std::to_string(rank), scenario, press,
                                    std::to_string(ratio),   out};
  });
}

at::Tensor read_tensor(std::FILE* in, at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor t = at::empty(sizes, dtype);
  EXPECT_EQ(std::fread(t.data_ptr(), t.element_size(), static_cast<size_t>(t.numel()), in),
            static_cast<size_t>(t.numel()));
  return t;
}

// What a rank keeps in `scenario` ("per_rank": the press on its heads alone; "global": the whole
// layer's compression restricted to its heads), computed in this process.
KV expected_kv(const std::string& scenario, const char* name, int rank, int world) {
  const LayerInputs layer = testing::distributed_layer();
  const distributed::HeadShard shard = distributed::head_shard(4, rank, world);
  if (scenario == "per_rank") return make_press(name, 0.5)->compress(distributed::rank_share(layer, shard));
  const KV whole = make_press(name, 0.5)->compress(layer);
  return {whole.keys.narrow(1, shard.first(), shard.count()), whole.values.narrow(1, shard.first(), shard.count()),
          whole.kept_indices.narrow(1, shard.first(), shard.count())};
}
at::Tensor expected_mask(const std::string& scenario, const char* name, int rank, int world) {
  const LayerInputs layer = testing::distributed_layer();
  const distributed::HeadShard shard = distributed::head_shard(4, rank, world);
  if (scenario == "per_rank")
    return make_press(name, 0.5)->compress_ragged(distributed::rank_share(layer, shard)).keep_mask;
  return make_press(name, 0.5)->compress_ragged(layer).keep_mask.narrow(1, shard.first(), shard.count());
}

// Each rank of 2 and 4 compresses its heads with KnormPress, SnapKVPress, TOVAPress (scores averaged
// over every query head) and AdaKVPress (budgets across heads) in `scenario`, as expected_kv says.
void expect_ranks_keep(const std::string& scenario) {
  for (int world : {2, 4}) {
    for (const char* name : {"KnormPress", "SnapKVPress", "TOVAPress"}) {
      const RankRun run = run_ranks(world, scenario, name, 0.5);
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_EQ(run.exit_codes[rank], 0) << name << ", rank " << rank << " of " << world;
        const KV want = expected_kv(scenario, name, rank, world);
        std::FILE* in = std::fopen(run.outputs[rank].c_str(), "rb");
        ASSERT_NE(in, nullptr);
        const at::Tensor kept = read_tensor(in, want.kept_indices.sizes(), at::kLong);
        const at::Tensor keys = read_tensor(in, want.keys.sizes(), at::kFloat);
        const at::Tensor values = read_tensor(in, want.values.sizes(), at::kFloat);
        EXPECT_EQ(std::fgetc(in), EOF) << "rank " << rank << " wrote more than its share";
        std::fclose(in);
        EXPECT_TRUE(at::equal(kept, want.kept_indices)) << name << ", rank " << rank << " of " << world;
        EXPECT_TRUE(at::equal(keys, want.keys) && at::equal(values, want.values)) << name << ", rank " << rank;
      }
    }
    // A head-ragged press: AdaKV's budgets across the rank's heads alone, or across every rank's.
    const RankRun ragged = run_ranks(world, scenario, "AdaKVPress", 0.5);
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_EQ(ragged.exit_codes[rank], 0) << "AdaKVPress, rank " << rank << " of " << world;
      const at::Tensor want = expected_mask(scenario, "AdaKVPress", rank, world);
      std::FILE* in = std::fopen(ragged.outputs[rank].c_str(), "rb");
      ASSERT_NE(in, nullptr);
      const at::Tensor mask = read_tensor(in, want.sizes(), at::kBool);
      EXPECT_EQ(std::fgetc(in), EOF);
      std::fclose(in);
      EXPECT_TRUE(at::equal(mask, want)) << "AdaKVPress, rank " << rank << " of " << world;
      // Budgets differ across a rank's heads (else this would not test a ragged press).
      if (world == 2)
        EXPECT_FALSE(at::equal(mask.sum(-1), mask.sum(-1).select(1, 0).unsqueeze(1).expand_as(mask.sum(-1))));
    }
  }
}

TEST(Distributed, EachRankCompressesItsHeadsAloneInPerRankMode) { expect_ranks_keep("per_rank"); }

TEST(Distributed, EachRankKeepsWhatTheWholeLayerKeepsOfItsHeadsInGlobalMode) {
  expect_ranks_keep("global");
  // And the two modes differ for the presses that span heads (else the test above proves nothing).
  for (const char* name : {"TOVAPress"})
    EXPECT_FALSE(
        at::equal(expected_kv("global", name, 0, 2).kept_indices, expected_kv("per_rank", name, 0, 2).kept_indices))
        << name;
  EXPECT_FALSE(at::equal(expected_mask("global", "AdaKVPress", 0, 2), expected_mask("per_rank", "AdaKVPress", 0, 2)));
}

TEST(Distributed, ADifferentConfigurationIsRefusedOnEveryRank) {
  for (int world : {2, 4}) {
    const RankRun run = run_ranks(world, "mismatch", "KnormPress", 0.5);
    for (int rank = 0; rank < world; ++rank) EXPECT_EQ(run.exit_codes[rank], 3) << "rank " << rank << " of " << world;
  }
}

TEST(Distributed, ARankThatLeavesMakesTheOthersFailNotWait) {
  // Rank 1 exits after the group forms: rank 0's setup fails at once.
  const RankRun gone = run_ranks(2, "die", "KnormPress", 0.5);
  EXPECT_EQ(gone.exit_codes[0], 4);
  EXPECT_LT(gone.seconds[0], 30.0);
  // Rank 1 stalls 8 s before its setup: rank 0 fails after the group's 5 s timeout, rank 1 then too.
  const RankRun stalled = run_ranks(2, "stall", "KnormPress", 0.5);
  EXPECT_EQ(stalled.exit_codes[0], 4);
  EXPECT_EQ(stalled.exit_codes[1], 4);
  EXPECT_GE(stalled.seconds[0], 4.5);
  EXPECT_LT(stalled.seconds[0], 30.0);
  // In global mode rank 1 leaves between the setup and the layer: rank 0's all-gather of AdaKV's
  // scores fails (at once, or after the timeout), it does not wait.
  const RankRun mid = run_ranks(2, "die_mid", "AdaKVPress", 0.5);
  EXPECT_EQ(mid.exit_codes[0], 4);
  EXPECT_LT(mid.seconds[0], 30.0);
}

TEST(Distributed, HeadShardsAndModesAreChecked) {
  const distributed::HeadShard shard = distributed::head_shard(8, 3, 4);
  EXPECT_EQ(shard.count(), 2);
  EXPECT_EQ(shard.first(), 6);
  testing::expect_error([] { distributed::head_shard(6, 0, 4); },
                        {"head_shard: the world size (4) must divide kv_heads, got kv_heads 6"});
  testing::expect_error([] { distributed::head_shard(8, 4, 4); },
                        {"head_shard: rank must be in [0, world), got rank 4 of world 4"});
  const testing::TemporaryFolder dir("kvpress_dist_single");
  auto group = distributed::gloo_group(dir.file("store"), 0, 1, std::chrono::milliseconds(5000));
  // A press of an engine's own that needs every head in a way it does not exchange.
  struct WholeLayerKnorm : KnormPress {
    using KnormPress::KnormPress;
    HeadSpan head_span() const override { return HeadSpan::kWholeLayer; }
  };
  for (distributed::BudgetMode mode : {distributed::BudgetMode::kPerRank, distributed::BudgetMode::kGlobal})
    testing::expect_error(
        [&] { distributed::ShardedPress(std::make_shared<WholeLayerKnorm>(0.5), group, 4, mode); },
        {"ShardedPress: KnormPress cannot be sharded across ranks: its scores need every head of the layer",
         "(head_span whole_layer)"});
  const distributed::ShardedPress alone(make_press("KnormPress", 0.5), group, 4, distributed::BudgetMode::kPerRank);
  testing::expect_error(
      [&] {
        alone.compress(distributed::rank_share(testing::distributed_layer(), {0, 2, 4}));
      },
      {"ShardedPress.compress: keys must hold this rank's 4 KV heads ([B, 4, S, D]), got [1, 2, 96, 16]"});
  // An engine's inputs never carry an exchange of their own: the ShardedPress sets its group's.
  struct OneRank : HeadExchange {
    at::Tensor gather_heads(const at::Tensor& local) const override { return local; }
    at::Tensor sum_over_ranks(const at::Tensor& partial) const override { return partial; }
    at::Tensor max_over_ranks(const at::Tensor& partial) const override { return partial; }
  };
  LayerInputs with_exchange = testing::distributed_layer();
  with_exchange.head_exchange = std::make_shared<const OneRank>();
  testing::expect_error([&] { alone.compress(with_exchange); },
                        {"ShardedPress.compress: local.head_exchange and local.kv_head_range must be unset (the "
                         "ShardedPress sets them)"});
}

// The NCCL path (listed for the GPU check, benchmarks/gpu_check.sh's *Cuda* tests): on a one-rank
// NCCL group, a ShardedPress in global mode runs its exchanges (all-gathers, all-reduces) on CUDA
// tensors and keeps what the press keeps of the whole layer on the same device. Its CPU half runs
// the same over a one-rank Gloo group.
TEST(DistributedCuda, AnNcclGroupRunsTheHeadExchangeOnTheDevice) {
  const std::string no_cuda = testing::cuda_half_unavailable();
  const testing::TemporaryFolder dir("kvpress_dist_nccl");
  const LayerInputs layer = testing::distributed_layer();
  const auto kept_by = [](const distributed::ShardedPress& sharded, const BasePress& press, const LayerInputs& in) {
    if (press.head_ragged()) return sharded.compress_ragged(in).keep_mask.cpu();
    return sharded.compress(in).kept_indices.cpu();
  };
  const auto kept_whole = [](const BasePress& press, const LayerInputs& in) {
    return press.head_ragged() ? press.compress_ragged(in).keep_mask.cpu() : press.compress(in).kept_indices.cpu();
  };
  auto gloo = distributed::gloo_group(dir.file("gloo"), 0, 1, std::chrono::milliseconds(30000));
  c10::intrusive_ptr<c10d::ProcessGroup> nccl;
  LayerInputs on_device = layer;
  if (no_cuda.empty()) {
    nccl = distributed::nccl_group(dir.file("nccl"), 0, 1, std::chrono::milliseconds(30000));
    on_device.keys = layer.keys.cuda();
    on_device.values = layer.values.cuda();
    on_device.queries = layer.queries.cuda();
  }
  for (const char* name : {"TOVAPress", "AdaKVPress"}) {
    SCOPED_TRACE(name);
    const std::shared_ptr<const BasePress> press = make_press(name, 0.5);
    const distributed::ShardedPress on_gloo(press, gloo, 4, distributed::BudgetMode::kGlobal);
    EXPECT_TRUE(at::equal(kept_by(on_gloo, *press, layer), kept_whole(*press, layer)));
    EXPECT_GT(on_gloo.exchange_stats().collectives, 0);
    if (!no_cuda.empty()) continue;
    const distributed::ShardedPress on_nccl(press, nccl, 4, distributed::BudgetMode::kGlobal);
    EXPECT_TRUE(at::equal(kept_by(on_nccl, *press, on_device), kept_whole(*press, on_device)));
    EXPECT_GT(on_nccl.exchange_stats().collectives, 0);
  }
  if (!no_cuda.empty()) GTEST_SKIP() << no_cuda << " (the Gloo half ran; the NCCL half runs in the GPU check)";
}

std::vector<int64_t> read_values(std::FILE* in, size_t n) {
  std::vector<int64_t> v(n);
  EXPECT_EQ(std::fread(v.data(), sizeof(int64_t), n, in), n);
  return v;
}

// Item 3: a prefill worker's compressed sequence, sent to a decode worker that adopts it into its
// own cache (another page size), decodes the tokens one process gives; what crosses is the kept
// tokens' keys, values and positions plus a header bounded by the model's shape, so a press at
// ratio r sends (1 - r) of the uncompressed sequence's token bytes.
TEST(Distributed, APrefillWorkersSequenceDecodesOnAnotherAsInOneProcess) {
  const llama::LlamaModel& model = testing::tiny_model();
  const llama::LlamaConfig& config = model.config();
  const int64_t layers = config.num_layers, kv_heads = config.num_kv_heads, head_dim = config.head_dim;
  const std::vector<int64_t> prompt = testing::transfer_prompt();
  const int64_t whole = layers * kv_heads * static_cast<int64_t>(prompt.size());  // tokens without a press
  for (const char* name : {"none", "SnapKVPress", "AdaKVPress"}) {
    SCOPED_TRACE(name);
    const RankRun run = run_transfer("transfer", name, 0.5);
    ASSERT_EQ(run.exit_codes[0], 0);
    ASSERT_EQ(run.exit_codes[1], 0);
    std::FILE* sender = std::fopen(run.outputs[0].c_str(), "rb");
    std::FILE* receiver = std::fopen(run.outputs[1].c_str(), "rb");
    ASSERT_TRUE(sender != nullptr && receiver != nullptr);
    const std::vector<int64_t> sent = read_values(sender, 4);
    const std::vector<int64_t> tokens = read_values(receiver, testing::kTransferNewTokens);
    const std::vector<int64_t> received = read_values(receiver, 4);
    std::fclose(sender);
    std::fclose(receiver);

    const std::shared_ptr<const BasePress> press = std::string(name) == "none" ? nullptr : make_press(name, 0.5);
    llama::GenerationOptions options;
    options.max_new_tokens = testing::kTransferNewTokens;
    options.press = press.get();
    options.stop_at_eos = false;
    EXPECT_EQ(tokens, llama::generate_greedy(model, prompt, {}, options).tokens);

    EXPECT_EQ(sent, received);
    const int64_t kept = sent[0];
    EXPECT_EQ(kept, press ? whole / 2 : whole);   // 75 of 150 tokens per head (AdaKV: over the layer's heads)
    EXPECT_EQ(sent[1], kept * 2 * head_dim * 4);  // float32 keys and values
    EXPECT_EQ(sent[2], kept * 4);                 // int32 positions
    EXPECT_EQ(sent[3], 8 * (8 + layers * kv_heads + layers + 1));  // preamble, lengths, next positions, 1 token id
  }
}

TEST(Distributed, ATransferThatCannotCompleteFailsOnBothSidesNotWaits) {
  const RankRun gone = run_transfer("sender_dies", "SnapKVPress", 0.5);
  EXPECT_EQ(gone.exit_codes[1], 4) << "the decode worker must fail at the preamble";
  EXPECT_LT(gone.seconds[1], 30.0);
  const RankRun full = run_transfer("small_pool", "SnapKVPress", 0.5);
  EXPECT_EQ(full.exit_codes[0], 3) << "the prefill worker must learn that the decode worker refused";
  EXPECT_EQ(full.exit_codes[1], 3) << "the decode worker must refuse a sequence its pool cannot hold";

  const testing::TemporaryFolder dir("kvpress_transfer_single");
  auto group = distributed::gloo_group(dir.file("store"), 0, 1, std::chrono::milliseconds(5000));
  PagedCacheOptions options;
  PagedKVCache cache(options);
  const SequenceId seq = cache.add_sequence();
  testing::expect_error([&] { distributed::send_sequence(group, 0, cache, seq); },
                        {"send_sequence: dst must be another rank of the group ([0, 1) but 0), got 0"});
  testing::expect_error([&] { distributed::receive_sequence(group, 1, cache); },
                        {"receive_sequence: src must be another rank of the group ([0, 1) but 0), got 1"});
}

}  // namespace
}  // namespace kvpress
