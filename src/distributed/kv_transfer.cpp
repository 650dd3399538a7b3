// kvpress::distributed's compressed KV transfer (kvpress/distributed.h): a sequence's stored tokens
// from one rank's PagedKVCache to another's over c10d point-to-point messages.
//
// The messages, in order, all with the caller's tag:
//   sender -> receiver  preamble int64[8]: magic, version, layers, kv_heads, head_dim, dtype, tokens,
//                       token_ids count
//                       header int64[layers * kv_heads + layers + token_ids]: lengths, next
//                       positions, token ids
//                       positions int32[tokens], keys and values [tokens, head_dim] (when tokens > 0)
//   receiver -> sender  answer int64[1]: an Answer
// The receiver takes every message before it checks the sequence against its cache, so that a
// sender never waits for a receiver that refused.
#include <ATen/ATen.h>

#include <chrono>
#include <limits>
#include <string>
#include <vector>

#include "distributed/wait_for.h"
#include "kvpress/distributed.h"

namespace kvpress::distributed {
namespace {

constexpr int64_t kMagic = 0x6b7670726573734b;  // "kvpressK"
constexpr int64_t kVersion = 1;
constexpr int64_t kPreambleLength = 8;

// The receiver's answer: adopted, or not (PagedKVCache::adopt_sequence raised; its error, on the
// receiver, says why: another shape or dtype, or too few free pages).
enum Answer : int64_t { kAdopted = 0, kNotAdopted = 2 };

std::string who(const char* op, int64_t from, int64_t to) {
  return std::string(op) + ": rank " + std::to_string(from) + " to rank " + std::to_string(to);
}

// The header's length in int64 entries.
int64_t header_length(int64_t layers, int64_t kv_heads, int64_t token_ids) {
  return layers * kv_heads + layers + token_ids;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where the messages live: on the current CUDA device when the group has a CUDA backend (NCCL),
// else in host memory (Gloo). Both ends derive it from the group alone, so they agree.
at::Device wire_device(const c10d::ProcessGroup& group) {
  for (const c10::Device& d : group.getDeviceTypes())
    if (d.is_cuda()) return at::Device(at::kCUDA, c10::DeviceIndex(-1));
  return at::kCPU;
}

TransferStats counts(int64_t tokens, int64_t head_dim, at::ScalarType dtype, int64_t header_entries) {
  TransferStats s;
  s.tokens = tokens;
  s.kv_bytes = tokens * 2 * head_dim * static_cast<int64_t>(c10::elementSize(dtype));
  s.position_bytes = tokens * static_cast<int64_t>(sizeof(int32_t));
  s.header_bytes = (kPreambleLength + header_entries) * static_cast<int64_t>(sizeof(int64_t));
  return s;
}

}  // namespace

TransferStats send_sequence(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int dst, const PagedKVCache& cache,
                            SequenceId seq, const std::vector<int64_t>& token_ids, int tag) {
  constexpr const char* op = "send_sequence";
  TORCH_CHECK(group, op, ": group must not be null");
  TORCH_CHECK(dst >= 0 && dst < group->getSize() && dst != group->getRank(), op,
              ": dst must be another rank of the group ([0, ", group->getSize(), ") but ", group->getRank(), "), got ",
              dst);
  const SequenceTokens t = cache.export_sequence(seq);
  const int64_t n = t.tokens();
  TORCH_CHECK(n == 0 || t.positions.max().item<int64_t>() <= std::numeric_limits<int32_t>::max(), op,
              ": positions must fit in int32 for the transfer, got ", t.positions.max().item<int64_t>());
  const std::string from_to = who(op, group->getRank(), dst);
  const at::Device wire = wire_device(*group);
  const auto t0 = std::chrono::steady_clock::now();

  std::vector<int64_t> header = t.lengths;
  header.insert(header.end(), t.next_positions.begin(), t.next_positions.end());
  header.insert(header.end(), token_ids.begin(), token_ids.end());
  std::vector<std::vector<at::Tensor>> messages{
      {at::tensor({kMagic, kVersion, t.num_layers, t.kv_heads, t.head_dim, static_cast<int64_t>(t.dtype), n,
                   static_cast<int64_t>(token_ids.size())},
                  at::kLong)
           .to(wire)},
      {at::tensor(at::ArrayRef<int64_t>(header), at::kLong).to(wire)}};
  if (n > 0) {
    messages.push_back({t.positions.to(wire, at::kInt)});
    messages.push_back({t.keys.to(wire).contiguous()});
    messages.push_back({t.values.to(wire).contiguous()});
  }
  static const char* const kSteps[] = {"the preamble", "the header", "the positions", "the keys", "the values"};
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  for (size_t i = 0; i < messages.size(); ++i)
    sends.push_back(detail::start_operation([&] { return group->send(messages[i], dst, tag); }, from_to, kSteps[i]));
  for (size_t i = 0; i < sends.size(); ++i) detail::wait_for(sends[i], from_to, kSteps[i]);
  std::vector<at::Tensor> answer{at::empty({1}, at::TensorOptions(at::kLong).device(wire))};
  detail::run_operation([&] { return group->recv(answer, dst, tag); }, from_to, "the receiver's answer");
  const int64_t a = answer[0].item<int64_t>();  // (a device tensor's item() waits for it)
  TORCH_CHECK(a == kAdopted, from_to, ": the receiver refused sequence ", seq,
              ": its cache could not adopt it (another shape or dtype, or too few free pages; the receiver's error "
              "says which); the sequence stays in this cache");
  TransferStats s = counts(n, t.head_dim, t.dtype, static_cast<int64_t>(header.size()));
  s.seconds = seconds_since(t0);
  return s;
}

ReceivedSequence receive_sequence(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int src, PagedKVCache& cache,
                                  int tag) {
  constexpr const char* op = "receive_sequence";
  TORCH_CHECK(group, op, ": group must not be null");
  TORCH_CHECK(src >= 0 && src < group->getSize() && src != group->getRank(), op,
              ": src must be another rank of the group ([0, ", group->getSize(), ") but ", group->getRank(), "), got ",
              src);
  const std::string from_to = who(op, src, group->getRank());
  const at::Device wire = wire_device(*group);
  // A message of `sizes` and `dtype`, received on the wire's device, returned in host memory for the
  // header's fields (keys and values stay where they came: adopt_sequence moves them to the cache).
  const auto receive = [&](at::IntArrayRef sizes, at::ScalarType dtype, const char* step) {
    std::vector<at::Tensor> message{at::empty(sizes, at::TensorOptions(dtype).device(wire))};
    detail::run_operation([&] { return group->recv(message, src, tag); }, from_to, step);
    return message[0];
  };
  const auto t0 = std::chrono::steady_clock::now();
  const at::Tensor preamble = receive({kPreambleLength}, at::kLong, "the preamble").cpu();
  const int64_t* p = preamble.const_data_ptr<int64_t>();
  TORCH_CHECK(p[0] == kMagic && p[1] == kVersion, from_to, ": the first message is not a sequence of send_sequence ",
              "version ", kVersion, " (magic ", p[0], ", version ", p[1], ")");
  SequenceTokens t;
  t.num_layers = p[2];
  t.kv_heads = p[3];
  t.head_dim = p[4];
  const int64_t n = p[6], n_ids = p[7];
  TORCH_CHECK(t.num_layers > 0 && t.kv_heads > 0 && t.head_dim > 0 && n >= 0 && n_ids >= 0 &&
                  (p[5] == static_cast<int64_t>(at::kFloat) || p[5] == static_cast<int64_t>(at::kHalf) ||
                   p[5] == static_cast<int64_t>(at::kBFloat16)),
              from_to, ": the preamble's shape is not a cache's: layers ", t.num_layers, ", kv_heads ", t.kv_heads,
              ", head_dim ", t.head_dim, ", dtype code ", p[5], ", tokens ", n, ", token ids ", n_ids);
  t.dtype = static_cast<at::ScalarType>(p[5]);
  const at::Tensor header = receive({header_length(t.num_layers, t.kv_heads, n_ids)}, at::kLong, "the header").cpu();
  const int64_t* h = header.const_data_ptr<int64_t>();
  const int64_t n_lengths = t.num_layers * t.kv_heads;
  t.lengths.assign(h, h + n_lengths);
  t.next_positions.assign(h + n_lengths, h + n_lengths + t.num_layers);
  ReceivedSequence out;
  out.token_ids.assign(h + n_lengths + t.num_layers, h + header.numel());
  t.positions = at::empty({0}, at::kLong);
  t.keys = t.values = at::empty({0, t.head_dim}, t.dtype);
  if (n > 0) {
    t.positions = receive({n}, at::kInt, "the positions").to(at::kCPU, at::kLong);
    t.keys = receive({n, t.head_dim}, t.dtype, "the keys");
    t.values = receive({n, t.head_dim}, t.dtype, "the values");
  }
  // Adopt (its checks are the cache's: shape, dtype, free pages), then answer either way: the sender
  // waits for the answer.
  int64_t answer = kAdopted;
  std::string why;
  try {
    out.seq = cache.adopt_sequence(t);
  } catch (const c10::Error& e) {
    answer = kNotAdopted;
    why = e.what_without_backtrace();
  }
  std::vector<at::Tensor> reply{at::tensor({answer}, at::kLong).to(wire)};
  detail::run_operation([&] { return group->send(reply, src, tag); }, from_to, "the answer");
  TORCH_CHECK(answer == kAdopted, from_to, ": ", why, "; the sender was told");
  out.stats = counts(n, t.head_dim, t.dtype, header.numel());
  out.stats.seconds = seconds_since(t0);
  return out;
}

}  // namespace kvpress::distributed
