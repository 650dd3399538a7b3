// Paged per-head KV cache: the layout serving engines use (fixed-size pages from a shared pool),
// with per-head budgets, so that compression frees real memory. See docs/INTEGRATION.md.
//
// Per layer, a key pool and a value pool [num_pages, page_size, D]. Every page belongs to one
// (sequence, layer, KV head); head (s, l, h) holds length(s, l, h) tokens, token t at row
// t % page_size of its page list's entry t / page_size. A press's kept tokens are written straight
// into freshly taken pages (store()); the full-length cache is never stored. Pages come from one
// free list per layer and return to it when a head shrinks (compact()) or a sequence is freed.
//
//   kvpress::PagedCacheOptions opt;  // layers, kv_heads, head_dim, pages_per_layer, dtype, device
//   kvpress::PagedKVCache cache(opt);
//   auto a = cache.add_sequence(), b = cache.add_sequence();
//   for (int64_t layer = 0; layer < L; ++layer)  // prefill: k/v [T, Hkv, D] packed, cu_seqlens [3]
//     cache.store(layer, {a, b}, k, v, cu_seqlens, press.get(), fill_inputs);
//   cache.append(layer, {a, b}, k_new, v_new);                   // [2, Hkv, 1, D], decoding
//   at::Tensor out = cache.attention(layer, {a, b}, q_new);      // [2, Hq, 1, D]
//   cache.free_sequence(a);                                      // its pages go back to the pool
//
// Every mutating call either completes or raises a c10::Error leaving the cache as it was
// (running out of pages included). The page tables and per-head lengths live on the cache's device
// (one [slots, Hkv, max_pages] table and one [slots, Hkv] length table per layer, a slot per
// sequence); each mutation sends only the entries it changed, so a decoding step copies O(batch)
// integers to the device, not the tables. The host keeps the same lists (and the tokens' original
// positions) for bookkeeping. Not thread-safe: one engine thread mutates a cache (reads from
// several threads are safe while none mutates, e.g. under a shared lock the engine holds
// exclusively while it mutates). export_sequence's copies are the engine-free way out: a snapshot
// stays valid, and can be adopted and attended over on another thread, while the engine reuses
// the sequence's pages (tests/test_concurrency.cpp, under ThreadSanitizer).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "kvpress/kv_format.h"
#include "kvpress/presses/base_press.h"
#include "kvpress/types.h"

namespace kvpress {

struct PagedCacheOptions {
  int64_t num_layers = 1;
  int64_t kv_heads = 1;
  int64_t head_dim = 64;
  int64_t pages_per_layer = 1024;  // pool size of each layer
  static constexpr int64_t kDefaultPageSize = 16;
  int64_t page_size = kDefaultPageSize;  // tokens per page
  at::ScalarType dtype = at::kFloat;     // float32, float16 or bfloat16
  at::Device device = at::kCPU;
  // How full pages are stored (kvpress/kv_format.h): in `dtype` (kFull), or quantized (int8, fp8,
  // int4). A quantized cache keeps each head's last, partly filled page in `dtype` (its residual
  // rows) and quantizes the page when it fills.
  KVFormat kv_format = KVFormat::kFull;
};

using SequenceId = int64_t;

// One sequence's stored tokens out of a PagedKVCache (PagedKVCache::export_sequence), to adopt into
// another cache of the same layers, KV heads, head_dim and dtype, whatever its page size or pool
// (PagedKVCache::adopt_sequence): a prefill worker's compressed sequence handed to a decode worker
// (kvpress::distributed::send_sequence), or a sequence moved between pools. Tokens, not pages: a
// partly filled last page costs nothing, and a compressed sequence is as small as its kept tokens.
struct SequenceTokens {
  int64_t num_layers = 0, kv_heads = 0, head_dim = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> lengths;         // [num_layers * kv_heads]: head h of layer l at l * kv_heads + h
  std::vector<int64_t> next_positions;  // [num_layers]: each layer's PagedKVCache::next_position
  at::Tensor positions;                 // [tokens] int64 on the CPU: each token's original position
  at::Tensor keys, values;              // [tokens, head_dim]: layer by layer, head by head, storage order
  int64_t tokens() const;               // the sum of lengths
};

struct PagedCacheStats {
  int64_t num_layers = 0, pages_per_layer = 0, page_size = 0;
  int64_t bytes_per_page = 0;   // keys + values of one page: codes and scales when quantized
  int64_t pages_used = 0;       // over every layer
  int64_t pages_free = 0;       // over every layer
  int64_t peak_pages_used = 0;  // since construction or reset_peak()
  int64_t sequences = 0;
  int64_t tokens = 0;       // stored over every (sequence, layer, head)
  int64_t table_bytes = 0;  // the device page and length tables (grown as sequences and heads need)
  // A quantized cache's residual rows: a page of keys and values in the cache's dtype for each
  // (sequence slot, layer, KV head), grown with the tables; 0 for KVFormat::kFull.
  int64_t residual_bytes = 0;
  int64_t bytes_used() const { return pages_used * bytes_per_page; }
  int64_t bytes_total() const { return (pages_used + pages_free) * bytes_per_page; }
};

// What a kernel reads for a batch of sequences at one layer (ops::paged_attention's arguments).
struct PagedBatchView {
  // [B, Hkv, max_pages] int64 on the cache's device, max_pages the most pages a head of the batch
  // holds; entries past a head's ceil(length / page_size) pages are page ids of no meaning.
  at::Tensor page_table;
  at::Tensor lengths;  // [B, Hkv] int64 on the cache's device
  at::Tensor slots;    // [B] int64 on the cache's device: the sequences' rows of the tables and of the residual rows
};

// A quantized cache's storage of one layer (PagedKVCache::quantized_pool), what
// ops::paged_attention_quantized reads: head h of the sequence in table row `slot` keeps its full
// pages' codes and scales in the pools and its last length % page_size tokens at
// residual_keys/values[slot, h].
struct QuantizedPagePool {
  at::Tensor key_codes, value_codes;          // [pages_per_layer, page_size, code_bytes] uint8
  at::Tensor key_scales, value_scales;        // [pages_per_layer, ...] (kv_page_layout)
  at::Tensor residual_keys, residual_values;  // [slot capacity, Hkv, page_size, D] in the cache's dtype
};

// Completes sequence i's LayerInputs for a press at store(): the cache sets keys, values,
// layer_idx and num_layers; the callback adds what the press reads (queries, hidden_states,
// attentions, cos/sin, ...), each of sequence i alone at its own length S_i.
using SequenceInputsFn = std::function<void(int64_t i, LayerInputs& inputs)>;

class PagedKVCache {
 public:
  // Allocates the pools (num_layers x 2 x pages_per_layer x page_size x head_dim elements). Raises
  // unless every size is positive and dtype is floating.
  explicit PagedKVCache(const PagedCacheOptions& options);

  const PagedCacheOptions& options() const { return options_; }

  // ---- sequences ---------------------------------------------------------------------------------
  SequenceId add_sequence();           // an empty sequence (no pages yet)
  void free_sequence(SequenceId seq);  // returns its pages to the pools
  // Returns every page of the sequence to the pools and empties its layers; the id stays valid
  // (an engine preempting a sequence, or undoing a failed prefill).
  void reset_sequence(SequenceId seq);
  bool contains(SequenceId seq) const;
  std::vector<SequenceId> sequences() const;  // ascending ids

  // ---- prefill: compress while storing -------------------------------------------------------
  // One layer's prefill K/V of a batch of sequences, packed along tokens as FlashAttention's varlen
  // interface produces it: sequence i owns rows [cu_seqlens[i], cu_seqlens[i + 1]). With a press,
  // each sequence is scored alone at its own length (press->compress_ragged of its LayerInputs,
  // completed by `inputs`) and only the kept tokens are written, into freshly taken pages; without
  // one every token is stored. Each (sequence, layer) must be empty. The kept sets are those of
  // compressing each sequence alone. All or nothing: a failing press or too few free pages raise
  // before anything is written.
  void store(int64_t layer, const std::vector<SequenceId>& seqs,
             const at::Tensor& keys,        // [T, Hkv, D]
             const at::Tensor& values,      // [T, Hkv, D]
             const at::Tensor& cu_seqlens,  // [B + 1] int32 or int64, from 0 to T, non-decreasing
             const BasePress* press = nullptr, const SequenceInputsFn& inputs = {});
  // The same from a padded batch: sequence i is keys[i, :, :lengths[i]].
  void store_padded(int64_t layer, const std::vector<SequenceId>& seqs,
                    const at::Tensor& keys,     // [B, Hkv, S, D]
                    const at::Tensor& values,   // [B, Hkv, S, D]
                    const at::Tensor& lengths,  // [B] integer, 1 <= lengths[i] <= S
                    const BasePress* press = nullptr, const SequenceInputsFn& inputs = {});

  // ---- decoding ----------------------------------------------------------------------------------
  // Appends n tokens to every head of each sequence at `layer` (pages taken as needed), at the
  // positions next_position(seq, layer) .. + n - 1. All or nothing.
  void append(int64_t layer, const std::vector<SequenceId>& seqs,
              const at::Tensor& keys,     // [B, Hkv, n, D]
              const at::Tensor& values);  // [B, Hkv, n, D]
  // New pages append(layer, seqs, n tokens) would take (an engine checks capacity for a whole step
  // across layers before starting it).
  int64_t pages_to_append(int64_t layer, const std::vector<SequenceId>& seqs, int64_t n) const;
  // Undoes the last append of n tokens to each sequence at `layer` (a step that failed part-way):
  // drops each head's last n tokens, returns pages left empty, moves next_position back by n. In a
  // quantized cache, a page that is no longer full goes back to the residual rows dequantized.
  void remove_last(int64_t layer, const std::vector<SequenceId>& seqs, int64_t n);
  // Causal attention of each sequence's last n stored tokens' queries over its heads' pages
  // (ops::paged_attention): new token i sees every older token of its head and new tokens <= i.
  at::Tensor attention(int64_t layer, const std::vector<SequenceId>& seqs,
                       const at::Tensor& queries,                          // [B, Hq, n, D]
                       std::optional<double> scale = std::nullopt) const;  // -> [B, Hq, n, D]
  // The sequences' rows of the layer's device tables, gathered on the device.
  PagedBatchView batch_view(int64_t layer, const std::vector<SequenceId>& seqs) const;

  // ---- decode-time compression ---------------------------------------------------------------
  // Keeps, in every head of (seq, layer), the tokens where keep_mask is true, moved to the front of
  // the head's own pages in order; the pages left empty go back to the pool. Only rows whose slot
  // changes are copied; in a quantized cache a page whose rows change is quantized again from its
  // new rows, dequantized (its scales follow its rows). keep_mask [Hkv, L] bool with L >= every
  // head's length (entries at or past a head's length must be false).
  void compact(int64_t layer, SequenceId seq, const at::Tensor& keep_mask);
  // Several compactions as one mutation (a decoding step's, one per sequence and layer it
  // compresses): every one is checked and staged (its table upload, the rows it moves or quantizes
  // again) before any is applied, so a failure leaves the cache as it was. Each (layer, seq) at most
  // once.
  struct Compaction {
    int64_t layer;
    SequenceId seq;
    at::Tensor keep_mask;  // [Hkv, L] bool, as compact()'s
  };
  void compact(const std::vector<Compaction>& compactions);

  // ---- moving a sequence between caches ----------------------------------------------------------
  // Copies of every token the sequence stores, with their positions and each layer's next position
  // (a quantized cache's rows dequantized to its dtype: adopting them into a cache of the same format
  // and page size quantizes each page to the same codes).
  SequenceTokens export_sequence(SequenceId seq) const;
  // A new sequence holding `tokens` (any device; copied to the cache's): every head the lengths,
  // positions and K/V it had, every layer the same next position, so decoding continues as it would
  // have in the exporting cache. All or nothing: a shape or dtype unlike the cache's, or too few
  // free pages in any layer, raise before a page is taken.
  SequenceId adopt_sequence(const SequenceTokens& tokens);

  // ---- contents ----------------------------------------------------------------------------------
  int64_t length(SequenceId seq, int64_t layer, int64_t head) const;
  std::vector<int64_t> lengths(SequenceId seq, int64_t layer) const;  // per head
  // The position id the next token appended to (seq, layer) gets: the prefill length, or the kept
  // count after a press that re-rotates keys (KeyRerotationPress), plus the tokens appended since.
  int64_t next_position(SequenceId seq, int64_t layer) const;
  // Original positions of head h's stored tokens, in storage order (ascending).
  std::vector<int64_t> positions(SequenceId seq, int64_t layer, int64_t head) const;
  // Head h's pages in token order: every page holding a token, or in a quantized cache its full
  // pages only (its last length % page_size tokens are residual rows).
  const std::vector<int64_t>& pages(SequenceId seq, int64_t layer, int64_t head) const;
  // Copies of head h's tokens [length, D], and of a layer whose heads have equal lengths as a dense
  // [1, Hkv, L, D] pair (what a decoding press scores); a quantized cache's dequantized to its dtype.
  at::Tensor head_keys(SequenceId seq, int64_t layer, int64_t head) const;
  at::Tensor head_values(SequenceId seq, int64_t layer, int64_t head) const;
  std::pair<at::Tensor, at::Tensor> dense(SequenceId seq, int64_t layer) const;

  // ---- memory ------------------------------------------------------------------------------------
  PagedCacheStats stats() const;
  void reset_peak();
  int64_t free_pages(int64_t layer) const;
  // Raw pools for kernels: [pages_per_layer, page_size, D] (KVFormat::kFull; a quantized cache
  // raises and gives quantized_pool()).
  const at::Tensor& key_pool(int64_t layer) const;
  const at::Tensor& value_pool(int64_t layer) const;
  QuantizedPagePool quantized_pool(int64_t layer) const;  // a quantized cache's (raises for kFull)

 private:
  struct Head {
    std::vector<int64_t> pages;      // page ids in the layer's pools
    std::vector<int64_t> positions;  // original position of each stored token
    // Entries of `pages` already in the device table. Page lists only change at their end (a write
    // appends pages, compaction and removal drop the last ones), so this prefix stays valid.
    size_t synced_pages = 0;
  };
  struct SequenceLayer {
    std::vector<Head> heads;  // kv_heads entries
    int64_t next_position = 0;
    bool stored = false;  // store() ran (or append() started the layer)
  };
  struct Sequence {
    std::vector<SequenceLayer> layers;
    int64_t slot = 0;  // its row of the device tables
  };
  struct Layer {
    at::Tensor key_pool, value_pool;  // [pages_per_layer, page_size, D] (KVFormat::kFull)
    QuantizedPagePool quantized;      // a quantized cache's (residual rows grown with the tables)
    std::vector<int64_t> free_pages;  // a stack: the last entry is taken first
    at::Tensor page_table;            // [slot_capacity, Hkv, page_capacity] int64, on the device
    at::Tensor lengths;               // [slot_capacity, Hkv] int64, on the device
  };

  // One (sequence, head)'s share of a write: rows to put after the head's current tokens.
  struct HeadWrite {
    int64_t seq_index, head;
    at::Tensor keys, values;         // [n, D]
    std::vector<int64_t> positions;  // n original positions
  };
  // Takes the pages the writes need (all or nothing) and writes every row: with one paged_write,
  // or (quantized) the pages that fill quantized with one kv_quantize and the rest as residual rows.
  void write(int64_t layer, const std::vector<SequenceId>& seqs, std::vector<HeadWrite>& writes);
  // Rows bound for a quantized layer (paged_cache.cpp): pages to quantize and residual rows, staged
  // (quantized, indices on the device: what can fail) before they are written.
  class QuantizedRows;
  // The quantized half of write(): heads' rows after their current tokens, into `new_pages`.
  QuantizedRows quantized_write(int64_t layer, const std::vector<SequenceId>& seqs,
                                const std::vector<HeadWrite>& writes,
                                const std::vector<std::vector<int64_t>>& new_pages) const;
  bool quantized() const { return options_.kv_format != KVFormat::kFull; }
  // Pages in the table of a head of `length` tokens: every page that holds one (kFull), or only the
  // full ones (quantized: the rest are residual rows).
  int64_t table_pages(int64_t length) const;
  // Rows [n, D] of `heads` of (seq, layer), every token of each in storage order, one head after
  // another, in the cache's dtype (a quantized cache's dequantized).
  at::Tensor head_rows(int64_t layer, SequenceId seq, const std::vector<int64_t>& heads, bool keys) const;
  // remove_last(layer, seqs, n) in a quantized cache: the rows of each page that stops being full,
  // dequantized, as residual rows.
  QuantizedRows reopened_rows(int64_t layer, const std::vector<SequenceId>& seqs, int64_t n) const;
  // A compaction checked and staged (all that can fail done: paged_cache.cpp), and applying it.
  struct StagedCompaction;
  StagedCompaction stage_compaction(int64_t layer, SequenceId seq, const at::Tensor& keep_mask) const;
  void apply_compaction(const StagedCompaction& staged);
  // compact(layer, seq, ...) in a quantized cache: each head's pages from the first moved row on,
  // quantized again from the kept rows, and its new residual rows.
  QuantizedRows compacted_rows(int64_t layer, SequenceId seq, const std::vector<std::vector<int64_t>>& kept) const;
  // Shared by store() and store_padded(): sequence i's [1, Hkv, S_i, D] views.
  void store_views(int64_t layer, const std::vector<SequenceId>& seqs, const std::vector<at::Tensor>& keys,
                   const std::vector<at::Tensor>& values, const BasePress* press, const SequenceInputsFn& inputs,
                   const char* op);

  const Sequence& sequence_at(SequenceId seq, const char* op) const;
  Sequence& sequence_at(SequenceId seq, const char* op);
  void check_layer(int64_t layer, const char* op) const;
  void check_sequences(const std::vector<SequenceId>& seqs, const char* op) const;  // present and distinct
  int64_t pages_used_now() const;
  // A head's table state after a mutation: its first `page_count` pages (of `pages`) and length.
  struct HeadTableState {
    const std::vector<int64_t>* pages;
    size_t page_count;
    int64_t length;
  };
  using HeadTableStateFn = std::function<HeadTableState(size_t seq_index, int64_t head)>;
  // The table entries of `layer` that change for `seqs` (pages past each head's synced prefix, every
  // head's length), packed and already on the device. Staging is the part of a table update that
  // can fail (a host tensor, a copy to the device), so a mutation stages before it changes anything
  // and applies after it committed: a failure leaves cache and device tables as they were.
  struct TableUpload {
    at::Tensor packed;  // [2 * n_table + 2 * n_length] int64 on the device: indices then values
    int64_t n_table = 0, n_length = 0;
  };
  TableUpload stage_tables(int64_t layer, const std::vector<SequenceId>& seqs, const HeadTableStateFn& state) const;
  // Writes a staged upload into the layer's tables and marks the heads' pages synced; the host
  // state must now be the one staged.
  void apply_tables(int64_t layer, const std::vector<SequenceId>& seqs, const TableUpload& upload);
  // Grows every layer's tables to hold `slots` rows and `pages` entries per head (doubling).
  void reserve_tables(int64_t slots, int64_t pages);

  PagedCacheOptions options_;
  std::vector<Layer> layers_;
  std::map<SequenceId, Sequence> sequences_;
  SequenceId next_id_ = 0;
  std::vector<int64_t> free_slots_;  // rows of the device tables no sequence holds
  int64_t slot_capacity_ = 0, page_capacity_ = 0;
  int64_t peak_pages_used_ = 0;
};

}  // namespace kvpress
