// Presses over tensor-parallel ranks: what global budgets exchange per layer, against the time the
// compression takes (docs/PERFORMANCE.md, "Presses over ranks").
//
//   kvpress_bench_distributed [--ranks 2,4] [--seq 16384] [--repeats 3] [--transfer-seq 4096]
//                             [--transfer-ratios 0,0.25,0.5,0.75]
//                             [--presses KnormPress,SnapKVPress,TOVAPress,AdaKVPress,ChunkKVPress,CriticalAdaKVPress]
//
// One Llama-3.1-8B layer (B = 1, Hq = 32, Hkv = 8, D = 128, hidden 4096, float32, ratio 0.5; keys,
// values, the queries of the last 64 positions and o_proj, seeded), compressed by each press:
//   * in one process, the whole layer (the reference);
//   * by `world` ranks, separate processes this binary starts (each re-executes it with --rank), in
//     a Gloo group on loopback, each its share of the heads, in global mode: per layer, the slowest
//     rank's compression time, what a rank sent and received in the exchanges and the time it spent
//     in them (waiting for slower ranks included), the transfer alone (the same payloads all-gathered
//     right after a barrier), and the same compression in per-rank mode.
// Wrappers (AdaKVPress, ChunkKVPress, CriticalAdaKVPress) wrap their default inner press, KnormPress.
// Each rank runs hardware_concurrency / world intra-op threads (at least one). Medians of --repeats
// layers after one warm-up; the ranks start each layer together (a barrier, outside the timing).
// Prints the machine (CPU model, kernel ISA, date, commit) and one Markdown row per (press, world).
//
// With 2 ranks, also the compressed KV transfer (--transfer-seq S, 0: none): rank 0, a prefill
// worker, stores one sequence of S tokens in a PagedKVCache of Llama-3.1-8B's shape (32 layers,
// Hkv = 8, D = 128, bfloat16; every layer the same seeded K/V), compressed while storing by
// KnormPress at each --transfer-ratios ratio (0: no press), and sends it --repeats times to rank 1,
// a decode worker, which adopts it into its own cache and frees it: bytes sent (keys and values,
// positions, header) against the uncompressed sequence's, the median time per transfer (rank 0's
// export, the messages, rank 1's adoption and answer), and beside it the transport's floor: the
// same bytes as one Gloo message.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "kvpress/distributed.h"
#include "kvpress/ops.h"
#include "kvpress/registry.h"

extern char** environ;

namespace {

using kvpress::distributed::BudgetMode;

constexpr int64_t kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kHidden = 4096, kWindow = 64;
constexpr double kRatio = 0.5;

struct Options {
  std::vector<int> ranks{2, 4};
  int64_t seq = 16384;
  int repeats = 3;
  std::vector<std::string> presses{"KnormPress", "SnapKVPress",  "TOVAPress",
                                   "AdaKVPress", "ChunkKVPress", "CriticalAdaKVPress"};
  // A rank's run (set by the parent when it starts the ranks).
  int rank = -1, world = 0;
  std::string store, out;
  int64_t transfer_seq = 4096;
  std::vector<double> transfer_ratios{0.0, 0.25, 0.5, 0.75};
};

constexpr int64_t kTransferLayers = 32;

// The whole layer, the same in every process.
kvpress::LayerInputs llama_layer(int64_t seq) {
  at::manual_seed(0);
  kvpress::LayerInputs in;
  in.keys = at::randn({1, kKvHeads, seq, kHeadDim});
  in.values = at::randn({1, kKvHeads, seq, kHeadDim});
  in.queries = at::randn({1, kQHeads, kWindow, kHeadDim}).div_(std::sqrt(double(kHeadDim)));
  in.o_proj = at::randn({kHidden, kQHeads * kHeadDim}).div_(std::sqrt(double(kQHeads * kHeadDim)));
  in.num_heads = kQHeads;
  return in;
}

std::shared_ptr<const kvpress::BasePress> build_at(const std::string& name, double ratio) {
  return kvpress::make_press(name, kvpress::ratio_for(*kvpress::find_press(name), ratio), {});
}
std::shared_ptr<const kvpress::BasePress> build(const std::string& name) { return build_at(name, kRatio); }

// The transfer alone: the press's collectives as all-gathers of the same payload, each started right
// after a barrier (so no rank waits for a slower one's compression), median over `repeats`.
double transfer_ms(c10d::ProcessGroup& group, const kvpress::distributed::ExchangeStats& exchanged, int repeats) {
  if (exchanged.collectives == 0) return 0.0;
  const at::Tensor payload = at::zeros({exchanged.bytes_sent / exchanged.collectives / 4});
  std::vector<std::vector<at::Tensor>> gathered(1);
  for (int64_t r = 0; r < group.getSize(); ++r) gathered[0].push_back(at::empty_like(payload));
  std::vector<at::Tensor> input{payload};
  double total = 0.0;
  for (int64_t c = 0; c < exchanged.collectives; ++c) {
    const auto one = [&] {
      group.barrier()->wait();
      const auto t0 = std::chrono::steady_clock::now();
      group.allgather(gathered, input)->wait();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    std::vector<double> ms;
    for (int i = 0; i < repeats + 1; ++i) ms.push_back(one());
    std::sort(ms.begin(), ms.end());
    total += ms[ms.size() / 2];
  }
  return total;
}

// One row of the transfer table, as rank 1 (the decode worker) measured it.
struct TransferRow {
  double ratio = 0;
  kvpress::distributed::TransferStats stats;
  double median_ms = 0;
  double wire_ms = 0;  // the same bytes as one Gloo message
};

// Rank 0 prefills and sends, rank 1 receives: one row per ratio (written by rank 1 to `out`).
void measure_transfers(const Options& o, const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::ostream& out) {
  kvpress::PagedCacheOptions shape;
  shape.num_layers = kTransferLayers;
  shape.kv_heads = kKvHeads;
  shape.head_dim = kHeadDim;
  shape.dtype = at::kBFloat16;
  shape.pages_per_layer = kKvHeads * ((o.transfer_seq + shape.page_size - 1) / shape.page_size);
  kvpress::PagedKVCache cache(shape);
  at::manual_seed(1);
  const at::Tensor keys = at::randn({o.transfer_seq, kKvHeads, kHeadDim}).to(at::kBFloat16);
  const at::Tensor values = at::randn({o.transfer_seq, kKvHeads, kHeadDim}).to(at::kBFloat16);
  const at::Tensor cu_seqlens = at::tensor({int64_t{0}, o.transfer_seq}, at::kLong);
  for (double ratio : o.transfer_ratios) {
    std::vector<double> ms;
    kvpress::distributed::TransferStats stats;
    for (int i = 0; i < o.repeats + 1; ++i) {  // the first one warms up
      group->barrier()->wait();
      if (o.rank == 0) {
        const kvpress::SequenceId seq = cache.add_sequence();
        const auto press = ratio > 0 ? build_at("KnormPress", ratio) : nullptr;
        for (int64_t layer = 0; layer < kTransferLayers; ++layer)
          cache.store(layer, {seq}, keys, values, cu_seqlens, press.get());
        group->barrier()->wait();  // the receiver times from here
        kvpress::distributed::send_sequence(group, 1, cache, seq);
        cache.free_sequence(seq);
      } else {
        group->barrier()->wait();
        const auto t0 = std::chrono::steady_clock::now();
        const kvpress::distributed::ReceivedSequence received = kvpress::distributed::receive_sequence(group, 0, cache);
        if (i > 0)
          ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        stats = received.stats;
        cache.free_sequence(received.seq);
      }
    }
    // The transport alone: the same bytes as one Gloo message, rank 0 to rank 1.
    const int64_t bytes = o.rank == 1 ? stats.bytes() : 0;
    std::vector<at::Tensor> size{at::tensor({bytes}, at::kLong)};
    group->broadcast(size, c10d::BroadcastOptions{1})->wait();
    std::vector<at::Tensor> message{at::empty({size[0].item<int64_t>()}, at::kByte)};
    std::vector<double> wire_ms;
    for (int i = 0; i < o.repeats + 1; ++i) {
      group->barrier()->wait();
      const auto t0 = std::chrono::steady_clock::now();
      if (o.rank == 0) {
        group->send(message, 1, 1)->wait();
      } else {
        group->recv(message, 0, 1)->wait();
      }
      if (i > 0)
        wire_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    if (o.rank == 1) {
      std::sort(ms.begin(), ms.end());
      std::sort(wire_ms.begin(), wire_ms.end());
      out << ratio << '\t' << stats.tokens << '\t' << stats.kv_bytes << '\t' << stats.position_bytes << '\t'
          << stats.header_bytes << '\t' << ms[ms.size() / 2] << '\t' << wire_ms[wire_ms.size() / 2] << '\n';
    }
  }
}

// One rank: for each press, the median compression time in both modes and the global mode's
// exchanges per layer, one tab-separated line per press to o.out.
int run_rank(const Options& o) {
  at::set_num_threads(std::max<int>(1, static_cast<int>(std::thread::hardware_concurrency()) / o.world));
  auto group = kvpress::distributed::gloo_group(o.store, o.rank, o.world, std::chrono::minutes(10));
  const kvpress::LayerInputs local =
      kvpress::distributed::rank_share(llama_layer(o.seq), kvpress::distributed::head_shard(kKvHeads, o.rank, o.world));
  std::ofstream out(o.out);
  for (const std::string& name : o.presses) {
    const auto press = build(name);
    double ms[2] = {0, 0};
    kvpress::distributed::ExchangeStats exchanged;
    for (BudgetMode mode : {BudgetMode::kGlobal, BudgetMode::kPerRank}) {
      const kvpress::distributed::ShardedPress sharded(press, group, kKvHeads, mode);
      const auto layer = [&] {
        group->barrier()->wait();  // every rank starts the layer together
        if (press->head_ragged()) {
          sharded.compress_ragged(local);
        } else {
          sharded.compress(local);
        }
      };
      layer();  // warm-up
      const kvpress::distributed::ExchangeStats before = sharded.exchange_stats();
      std::vector<double> times;
      for (int i = 0; i < o.repeats; ++i) times.push_back(kvpress_bench::median_ms(layer, 1, 0));
      std::sort(times.begin(), times.end());
      ms[mode == BudgetMode::kGlobal ? 0 : 1] = times[times.size() / 2];
      if (mode == BudgetMode::kGlobal) {
        const kvpress::distributed::ExchangeStats after = sharded.exchange_stats();
        exchanged.collectives = (after.collectives - before.collectives) / o.repeats;
        exchanged.bytes_sent = (after.bytes_sent - before.bytes_sent) / o.repeats;
        exchanged.bytes_received = (after.bytes_received - before.bytes_received) / o.repeats;
        exchanged.seconds = (after.seconds - before.seconds) / o.repeats;
      }
    }
    out << name << '\t' << ms[0] << '\t' << ms[1] << '\t' << exchanged.collectives << '\t' << exchanged.bytes_sent
        << '\t' << exchanged.bytes_received << '\t' << exchanged.seconds * 1e3 << '\t'
        << transfer_ms(*group, exchanged, o.repeats) << '\n';
  }
  if (o.world == 2 && o.transfer_seq > 0) {
    std::ofstream transfers(o.out + ".transfer");
    measure_transfers(o, group, transfers);
    if (!transfers.good()) return 1;
  }
  return out.good() ? 0 : 1;
}

struct RankRow {
  double global_ms, per_rank_ms;
  int64_t collectives, sent, received;
  double exchange_ms, transfer_ms;
};

struct RanksResult {
  std::vector<std::map<std::string, RankRow>> rows;  // [rank][press name]
  std::vector<TransferRow> transfers;                // 2 ranks: rank 1's, one per transfer ratio
};

// Starts `world` ranks of this binary and reads their rows.
RanksResult run_ranks(const Options& o, int world, const std::string& self) {
  // (No std::filesystem: here it may resolve into libtorch's own copy, which crashes.)
  char dir_template[] = "/tmp/kvpress_bench_dist_XXXXXX";
  TORCH_CHECK(::mkdtemp(dir_template) != nullptr, "kvpress_bench_distributed: cannot make a temporary folder");
  const std::string dir = dir_template;
  const auto rank_file = [&](int rank) { return dir + "/rank" + std::to_string(rank); };
  std::string presses, ratios;
  for (const std::string& p : o.presses) presses += (presses.empty() ? "" : ",") + p;
  for (double r : o.transfer_ratios) ratios += (ratios.empty() ? "" : ",") + std::to_string(r);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::vector<std::string> args = {self,
                                     "--rank",
                                     std::to_string(rank),
                                     "--world",
                                     std::to_string(world),
                                     "--store",
                                     dir + "/store",
                                     "--out",
                                     rank_file(rank),
                                     "--seq",
                                     std::to_string(o.seq),
                                     "--repeats",
                                     std::to_string(o.repeats),
                                     "--presses",
                                     presses,
                                     "--transfer-seq",
                                     std::to_string(o.transfer_seq),
                                     "--transfer-ratios",
                                     ratios};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    TORCH_CHECK(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) == 0, "cannot start ", self);
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "kvpress_bench_distributed: a rank of ", world,
                " failed (status ", status, ")");
  }
  RanksResult result;
  result.rows.resize(static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    std::ifstream in(rank_file(rank));
    std::string name;
    RankRow row{};
    while (in >> name >> row.global_ms >> row.per_rank_ms >> row.collectives >> row.sent >> row.received >>
           row.exchange_ms >> row.transfer_ms)
      result.rows[static_cast<size_t>(rank)][name] = row;
    std::remove(rank_file(rank).c_str());
    std::ifstream transfers(rank_file(rank) + ".transfer");
    TransferRow t;
    while (transfers >> t.ratio >> t.stats.tokens >> t.stats.kv_bytes >> t.stats.position_bytes >>
           t.stats.header_bytes >> t.median_ms >> t.wire_ms)
      if (rank == 1) result.transfers.push_back(t);
    std::remove((rank_file(rank) + ".transfer").c_str());
  }
  std::remove((dir + "/store").c_str());
  ::rmdir(dir.c_str());
  return result;
}

std::string machine_line() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, cpu = "unknown CPU";
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  std::string commit = "unknown";
  if (FILE* git = popen("git -C " KVPRESS_SOURCE_DIR " rev-parse --short HEAD 2>/dev/null", "r")) {
    char buffer[64] = {0};
    if (std::fgets(buffer, sizeof buffer, git)) commit = std::string(buffer).substr(0, std::strcspn(buffer, "\n"));
    pclose(git);
  }
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  std::ostringstream out;
  out << cpu << ", " << std::thread::hardware_concurrency() << " hardware threads, kernels "
      << kvpress::ops::cpu_kernel_isa() << ", " << date << ", commit " << commit;
  return out.str();
}

std::string kib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", static_cast<double>(bytes) / 1024);
  return text;
}

// The transfer table: what crossed per ratio against the uncompressed sequence.
void print_transfers(const Options& o, const std::vector<TransferRow>& transfers) {
  if (transfers.empty()) return;
  std::cout << "\nPrefill -> decode transfer: one sequence of S=" << o.transfer_seq << " at Llama-3.1-8B's shape ("
            << kTransferLayers << " layers, Hkv=" << kKvHeads << ", D=" << kHeadDim
            << ", bfloat16), KnormPress while storing, 2 processes over Gloo on loopback; median of " << o.repeats
            << "\n\n| ratio | tokens sent (all layers and heads) | keys + values (MiB) | positions (KiB) | header (B) |"
               " total (MiB) | of the uncompressed | transfer (ms) | GB/s | the same bytes as one Gloo message (ms) |"
               "\n|---|---|---|---|---|---|---|---|---|---|\n";
  const double whole = static_cast<double>(transfers.front().stats.bytes());  // ratio 0 comes first
  for (const TransferRow& t : transfers) {
    const double bytes = static_cast<double>(t.stats.bytes());
    std::printf("| %.2f | %lld | %.1f | %.1f | %lld | %.1f | %.1f%% | %.1f | %.2f | %.1f |\n", t.ratio,
                static_cast<long long>(t.stats.tokens), static_cast<double>(t.stats.kv_bytes) / (1 << 20),
                static_cast<double>(t.stats.position_bytes) / 1024, static_cast<long long>(t.stats.header_bytes),
                bytes / (1 << 20), 100.0 * bytes / whole, t.median_ms, bytes / (t.median_ms * 1e6), t.wire_ms);
  }
}

int run_parent(const Options& o, const std::string& self) {
  std::cout << "Machine: " << machine_line() << "\n";
  std::cout << "Layer: B=1, Hq=" << kQHeads << ", Hkv=" << kKvHeads << ", D=" << kHeadDim << ", S=" << o.seq
            << ", float32, ratio " << kRatio << "; median of " << o.repeats << " layers\n\n";
  // The whole layer in one process, on every core.
  const kvpress::LayerInputs layer = llama_layer(o.seq);
  std::map<std::string, double> whole_ms;
  for (const std::string& name : o.presses) {
    const auto press = build(name);
    whole_ms[name] = kvpress_bench::median_ms(
        [&] {
          if (press->head_ragged()) {
            press->compress_ragged(layer);
          } else {
            press->compress(layer);
          }
        },
        o.repeats);
  }
  std::cout
      << "| press | ranks | one process, whole layer (ms) | global: slowest rank (ms) | per rank: slowest rank (ms)"
         " | collectives | sent / received per rank (KiB) | in the exchange, slowest rank (ms) | share of the"
         " global layer | transfer alone, slowest rank (ms) |\n|---|---|---|---|---|---|---|---|---|---|\n";
  std::vector<TransferRow> transfers;
  for (int world : o.ranks) {
    const RanksResult ranks = run_ranks(o, world, self);
    if (world == 2) transfers = ranks.transfers;
    for (const std::string& name : o.presses) {
      RankRow slowest{};
      for (const auto& rank : ranks.rows) {
        const RankRow& r = rank.at(name);
        slowest.global_ms = std::max(slowest.global_ms, r.global_ms);
        slowest.per_rank_ms = std::max(slowest.per_rank_ms, r.per_rank_ms);
        slowest.exchange_ms = std::max(slowest.exchange_ms, r.exchange_ms);
        slowest.transfer_ms = std::max(slowest.transfer_ms, r.transfer_ms);
        slowest.collectives = r.collectives;
        slowest.sent = std::max(slowest.sent, r.sent);
        slowest.received = std::max(slowest.received, r.received);
      }
      std::printf("| %s | %d | %.1f | %.1f | %.1f | %lld | %s / %s | %.2f | %.1f%% | %.2f |\n", name.c_str(), world,
                  whole_ms[name], slowest.global_ms, slowest.per_rank_ms, static_cast<long long>(slowest.collectives),
                  kib(slowest.sent).c_str(), kib(slowest.received).c_str(), slowest.exchange_ms,
                  100.0 * slowest.exchange_ms / slowest.global_ms, slowest.transfer_ms);
    }
  }
  print_transfers(o, transfers);
  return 0;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    TORCH_CHECK(i + 1 < argc, "kvpress_bench_distributed: ", arg, " needs a value");
    const std::string value = argv[++i];
    if (arg == "--ranks") {
      o.ranks.clear();
      for (double r : kvpress_bench::number_list(arg, value)) o.ranks.push_back(static_cast<int>(r));
    } else if (arg == "--seq") {
      o.seq = std::stoll(value);
    } else if (arg == "--repeats") {
      o.repeats = std::stoi(value);
    } else if (arg == "--presses") {
      o.presses.clear();
      std::stringstream list(value);
      for (std::string name; std::getline(list, name, ',');) o.presses.push_back(name);
    } else if (arg == "--transfer-seq") {
      o.transfer_seq = std::stoll(value);
    } else if (arg == "--transfer-ratios") {
      o.transfer_ratios = kvpress_bench::number_list(arg, value);
    } else if (arg == "--rank") {
      o.rank = std::stoi(value);
    } else if (arg == "--world") {
      o.world = std::stoi(value);
    } else if (arg == "--store") {
      o.store = value;
    } else if (arg == "--out") {
      o.out = value;
    } else {
      TORCH_CHECK(false, "kvpress_bench_distributed: unknown option ", arg);
    }
  }
  TORCH_CHECK(o.transfer_ratios.empty() || o.transfer_ratios.front() == 0.0,
              "kvpress_bench_distributed: --transfer-ratios must start with 0 (the uncompressed sequence)");
  TORCH_CHECK(o.repeats > 0 && o.seq > kWindow, "kvpress_bench_distributed: --repeats must be > 0 and --seq > ",
              kWindow);
  for (int world : o.ranks)
    TORCH_CHECK(world > 0 && kKvHeads % world == 0, "kvpress_bench_distributed: --ranks must divide ", kKvHeads,
                ", got ", world);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    if (o.rank >= 0) return run_rank(o);
    char self[4096] = {0};
    TORCH_CHECK(::readlink("/proc/self/exe", self, sizeof self - 1) > 0,
                "kvpress_bench_distributed: cannot find itself");
    return run_parent(o, self);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
