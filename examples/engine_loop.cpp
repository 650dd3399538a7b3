// A serving engine's loop over kvpress::PagedKVCache (docs/INTEGRATION.md), as a complete program:
// requests of different lengths arrive, are prefilled together and compressed while their K/V is
// stored, decode one token per step, are compacted in place by a decoding-time press (driven by the
// press lifecycle of kvpress/presses/base_press.h: one state per request, one update per layer and
// step), finish and hand their pages to the next request.
//
//   kvpress_engine_loop        # prints what happens and checks it; exits 1 if a check fails
//
// The "model" is a stand-in: every layer's keys, values and queries are random tensors drawn per
// (request, layer, token), so that the program needs no weights. An engine computes them with its
// own attention layers; everything else here is what it calls, in order.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kvpress/kvpress.h"

namespace {

constexpr int64_t kLayers = 2, kQueryHeads = 8, kKvHeads = 2, kHeadDim = 32;
constexpr int64_t kPageSize = 16, kPagesPerLayer = 96;
constexpr int64_t kNewTokens = 24, kMaxRunning = 2;
constexpr int64_t kCompactEvery = 8, kCompactTo = 96;  // decode-time budget per head

struct Request {
  int64_t id = 0, prompt_length = 0;
  kvpress::SequenceId seq = 0;
  int64_t generated = 0;
  std::shared_ptr<kvpress::PressSequenceState> press_state;  // the decoding press's, for this request
};

// The stand-in model: a layer's K, V [n, Hkv, D] and Q [n, Hq, D] for tokens [first, first + n) of
// a request, the same whenever they are asked for.
struct Projections {
  at::Tensor keys, values, queries;
};
Projections project(int64_t request, int64_t layer, int64_t first, int64_t n) {
  Projections p;
  std::vector<at::Tensor> k, v, q;
  for (int64_t t = first; t < first + n; ++t) {
    at::manual_seed(static_cast<uint64_t>((request * 131 + layer) * 100003 + t));
    k.push_back(at::randn({kKvHeads, kHeadDim}));
    v.push_back(at::randn({kKvHeads, kHeadDim}));
    q.push_back(at::randn({kQueryHeads, kHeadDim}));
  }
  return {at::stack(k), at::stack(v), at::stack(q)};
}

// Dense attention of one new token's queries [Hq, D] over what the cache holds for (seq, layer):
// the check that paged attention reads the right rows.
at::Tensor dense_reference(const kvpress::PagedKVCache& cache, kvpress::SequenceId seq, int64_t layer,
                           const at::Tensor& queries) {
  std::vector<at::Tensor> out;
  const int64_t group = kQueryHeads / kKvHeads;
  for (int64_t qh = 0; qh < kQueryHeads; ++qh) {
    const at::Tensor k = cache.head_keys(seq, layer, qh / group), v = cache.head_values(seq, layer, qh / group);
    const at::Tensor w = (k.matmul(queries[qh]) / std::sqrt(static_cast<double>(kHeadDim))).softmax(0);
    out.push_back(w.matmul(v));
  }
  return at::stack(out);  // [Hq, D]
}

bool check(bool ok, const char* what) {
  std::printf("  check: %s: %s\n", what, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main() {
  bool ok = true;
  // 1. One cache for the whole engine: per layer a key pool and a value pool of pages.
  kvpress::PagedCacheOptions options;
  options.num_layers = kLayers;
  options.kv_heads = kKvHeads;
  options.head_dim = kHeadDim;
  options.page_size = kPageSize;
  options.pages_per_layer = kPagesPerLayer;
  kvpress::PagedKVCache cache(options);

  // 2. The prefill press, built once and shared (presses are immutable): SnapKV compresses each
  //    prompt while it is stored; any registry press fits, head-ragged ones (AdaKVPress, ...) too.
  const auto prefill_press = kvpress::make_press("SnapKVPress", 0.5, {{"window_size", "16"}});
  //    The decoding press: kvpress's DecodingPress over KnormPress, every kCompactEvery steps a
  //    request longer than the budget keeps its best kCompactTo tokens per head.
  const auto decoding_press = kvpress::make_press("DecodingPress", 0.0,
                                                  {{"press", "KnormPress"},
                                                   {"compression_interval", std::to_string(kCompactEvery)},
                                                   {"target_size", std::to_string(kCompactTo)},
                                                   {"hidden_states_buffer_size", "0"}});
  // The stand-in's query projection is the identity and its positions rotate by nothing.
  const at::Tensor identity = at::eye(kQueryHeads * kHeadDim);
  const at::Tensor no_rotation_cos = at::ones({1, kHeadDim}), no_rotation_sin = at::zeros({1, kHeadDim});

  std::deque<Request> waiting;
  for (int64_t id = 0; id < 4; ++id) waiting.push_back({id, std::vector<int64_t>{300, 120, 57, 210}[id]});
  std::vector<Request> running;
  const auto pages_for = [](int64_t tokens) { return kKvHeads * ((tokens + kPageSize - 1) / kPageSize); };

  while (!waiting.empty() || !running.empty()) {
    // 3. Admission: a request starts when the pool holds its prompt stored whole plus its new
    //    tokens (the worst case: compression only helps), so no later step runs out of pages.
    std::vector<Request> admitted;
    int64_t free = kPagesPerLayer;
    for (int64_t layer = 0; layer < kLayers; ++layer) free = std::min(free, cache.free_pages(layer));
    for (const Request& r : running) free -= pages_for(kNewTokens - r.generated);
    while (!waiting.empty() && static_cast<int64_t>(running.size() + admitted.size()) < kMaxRunning &&
           pages_for(waiting.front().prompt_length) + pages_for(kNewTokens) <= free) {
      free -= pages_for(waiting.front().prompt_length) + pages_for(kNewTokens);
      admitted.push_back(waiting.front());
      waiting.pop_front();
    }

    // 4. Prefill the admitted requests together, packed along tokens (FlashAttention's varlen
    //    layout): per layer, store() scores each request at its own length and writes only the
    //    kept tokens into fresh pages. The callback gives the press what it reads beyond K/V.
    if (!admitted.empty()) {
      std::vector<kvpress::SequenceId> seqs;
      std::vector<int64_t> cu = {0};
      for (Request& r : admitted) {
        r.seq = cache.add_sequence();
        seqs.push_back(r.seq);
        cu.push_back(cu.back() + r.prompt_length);
      }
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        std::vector<Projections> per_request;
        std::vector<at::Tensor> k, v;
        for (const Request& r : admitted) {
          per_request.push_back(project(r.id, layer, 0, r.prompt_length));
          k.push_back(per_request.back().keys);
          v.push_back(per_request.back().values);
        }
        // (The engine's prefill attention runs here, over the packed batch, before the store.)
        const auto inputs = [&](int64_t i, kvpress::LayerInputs& in) {
          in.queries = per_request[static_cast<size_t>(i)].queries.permute({1, 0, 2}).unsqueeze(0);  // [1, Hq, S_i, D]
        };
        cache.store(layer, seqs, at::cat(k), at::cat(v), at::tensor(cu), prefill_press.get(), inputs);
      }
      for (Request& r : admitted) {
        r.press_state = decoding_press->new_sequence_state();  // fresh per request
        std::printf("request %lld: %lld-token prompt stored in %zu pages per head (uncompressed: %lld)\n",
                    static_cast<long long>(r.id), static_cast<long long>(r.prompt_length),
                    cache.pages(r.seq, 0, 0).size(),
                    static_cast<long long>((r.prompt_length + kPageSize - 1) / kPageSize));
        ok &= check(cache.length(r.seq, 0, 0) == r.prompt_length / 2,
                    "the prompt keeps int(S * (1 - 0.5)) tokens per head, as kvpress");
        running.push_back(r);
      }
    }

    // 5. One decoding step for every running request: append each layer's new K/V (pages taken as
    //    needed), then paged attention of the new queries over each head's pages.
    std::vector<kvpress::SequenceId> seqs;
    for (const Request& r : running) seqs.push_back(r.seq);
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      std::vector<at::Tensor> k, v, q;
      for (const Request& r : running) {
        const Projections p = project(r.id, layer, r.prompt_length + r.generated, 1);
        k.push_back(p.keys.permute({1, 0, 2}));  // [Hkv, 1, D]
        v.push_back(p.values.permute({1, 0, 2}));
        q.push_back(p.queries.permute({1, 0, 2}));  // [Hq, 1, D]
      }
      cache.append(layer, seqs, at::stack(k), at::stack(v));
      const at::Tensor out = cache.attention(layer, seqs, at::stack(q));  // [B, Hq, 1, D]
      if (layer == 0 && running.front().generated == 0) {
        const at::Tensor expected = dense_reference(cache, seqs[0], 0, q[0].squeeze(1));
        ok &= check(at::allclose(out[0].squeeze(1), expected, 1e-5, 1e-5),
                    "paged attention equals dense attention over the kept tokens");
      }
      // 6. The decoding press's hook, right after the layer's attention: it reads the request's
      //    whole layer only on the steps it compresses (a dense copy then); a replacement is applied
      //    with compact(), which moves the kept tokens to the front of the head's own pages and
      //    returns the emptied pages to the pool.
      for (size_t i = 0; i < running.size(); ++i) {
        const Request& r = running[i];
        kvpress::LayerInputs in;
        in.hidden_states = q[i].permute({1, 0, 2}).reshape({1, 1, kQueryHeads * kHeadDim});
        in.q_proj = identity;
        in.cos = no_rotation_cos;
        in.sin = no_rotation_sin;
        in.num_heads = kQueryHeads;
        in.layer_idx = layer;
        in.num_layers = kLayers;
        in.keys = k[i].unsqueeze(0);  // this step's token [1, Hkv, 1, D]
        in.values = v[i].unsqueeze(0);
        const int64_t tokens_seen = r.prompt_length + r.generated + 1;
        if (decoding_press->decoding_reads_cache(layer, 1, tokens_seen, *r.press_state))
          std::tie(in.keys, in.values) = cache.dense(r.seq, layer);  // [1, Hkv, L, D]
        const kvpress::DecodingUpdate update = decoding_press->decoding_update(in, tokens_seen, *r.press_state);
        // A press selecting once for the whole model (TriAttentionPress) answers at the last layer
        // with the slots every layer keeps; the others replace this layer.
        const bool every_layer = update.kind == kvpress::DecodingUpdate::Kind::kKeepEveryLayer;
        if (update.kind != kvpress::DecodingUpdate::Kind::kReplace && !every_layer) continue;
        const int64_t length = in.keys.size(2), before = cache.free_pages(layer);
        at::Tensor keep = at::zeros({kKvHeads, length}, at::kBool);  // [Hkv, L]
        keep.scatter_(1, (every_layer ? update.keep : update.replacement.kept_indices)[0], true);
        for (int64_t l = every_layer ? 0 : layer; l <= layer; ++l) cache.compact(l, r.seq, keep);
        if (layer == 0 && cache.length(r.seq, 0, 0) < length) {
          std::printf("request %lld: compacted %lld -> %lld tokens per head, %lld pages freed\n",
                      static_cast<long long>(r.id), static_cast<long long>(length),
                      static_cast<long long>(cache.length(r.seq, 0, 0)),
                      static_cast<long long>(cache.free_pages(0) - before));
        }
      }
      // (The engine's MLP and the next layer run here; the last layer's output gives the token.)
    }
    for (Request& r : running) ++r.generated;

    // 7. Finished requests free their pages; the next loop admits waiting ones into them.
    for (const Request& r : running) {
      if (r.generated < kNewTokens) continue;
      cache.free_sequence(r.seq);
      std::printf("request %lld: done, pages free now %lld of %lld per layer\n", static_cast<long long>(r.id),
                  static_cast<long long>(cache.free_pages(0)), static_cast<long long>(kPagesPerLayer));
    }
    running.erase(
        std::remove_if(running.begin(), running.end(), [](const Request& r) { return r.generated >= kNewTokens; }),
        running.end());
  }

  const kvpress::PagedCacheStats s = cache.stats();
  std::printf("peak: %lld of %lld pages (%lld bytes each); now %lld in use\n",
              static_cast<long long>(s.peak_pages_used), static_cast<long long>(s.pages_used + s.pages_free),
              static_cast<long long>(s.bytes_per_page), static_cast<long long>(s.pages_used));
  ok &= check(s.pages_used == 0 && s.sequences == 0, "every page is back in the pool");

  // 8. Errors leave the cache as it was: a request too long for the pool is refused whole.
  const kvpress::SequenceId big = cache.add_sequence();
  const Projections p = project(99, 0, 0, kPagesPerLayer * kPageSize);
  try {
    cache.store(0, {big}, p.keys, p.values, at::tensor({int64_t{0}, kPagesPerLayer * kPageSize}));
    ok &= check(false, "an oversized store is refused");
  } catch (const c10::Error& e) {
    std::printf("refused: %s\n", e.what_without_backtrace());
    ok &= check(cache.stats().pages_used == 0, "a refused store takes no page");
  }
  cache.free_sequence(big);
  return ok ? 0 : 1;
}
