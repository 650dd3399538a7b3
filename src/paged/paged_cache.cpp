// PagedKVCache: page allocation, compress-while-storing, appends, compaction and statistics.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <utility>

#include "checks.h"
#include "kvpress/ops.h"
#include "kvpress/paged.h"
#include "paged/fault_injection.h"
#include "paged/kv_codec.h"

namespace kvpress {

using checks::shape_str;

namespace {

// A host int64 vector as a tensor on `device`.
at::Tensor to_device(const std::vector<int64_t>& v, at::Device device) {
  return at::tensor(at::ArrayRef<int64_t>(v), at::kLong).to(device);
}

std::vector<int64_t> to_host_vector(const at::Tensor& t) {  // any integer tensor -> int64 values
  const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return {c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel()};
}

}  // namespace

PagedKVCache::PagedKVCache(const PagedCacheOptions& options) : options_(options) {
  constexpr const char* op = "PagedKVCache";
  checks::check_positive(op, "num_layers", options.num_layers);
  checks::check_positive(op, "kv_heads", options.kv_heads);
  checks::check_positive(op, "head_dim", options.head_dim);
  checks::check_positive(op, "pages_per_layer", options.pages_per_layer);
  checks::check_positive(op, "page_size", options.page_size);
  TORCH_CHECK(at::isFloatingType(options.dtype) && options.dtype != at::kDouble, op,
              ": dtype must be float32, float16 or bfloat16, got ", options.dtype);
  layers_.resize(static_cast<size_t>(options.num_layers));
  const auto tensor_options = at::TensorOptions().dtype(options.dtype).device(options.device);
  for (Layer& l : layers_) {
    if (quantized()) {
      for (const auto role : {KVRole::kKeys, KVRole::kValues}) {
        const KVPageLayout layout =
            kv_page_layout(options.kv_format, role, options.page_size, options.head_dim, options.dtype, op);
        std::vector<int64_t> scale_shape{options.pages_per_layer};
        scale_shape.insert(scale_shape.end(), layout.scale_shape.begin(), layout.scale_shape.end());
        at::Tensor codes =
            at::empty({options.pages_per_layer, options.page_size, layout.code_bytes}, tensor_options.dtype(at::kByte));
        at::Tensor scales = at::empty(scale_shape, tensor_options.dtype(layout.scale_dtype));
        (role == KVRole::kKeys ? l.quantized.key_codes : l.quantized.value_codes) = std::move(codes);
        (role == KVRole::kKeys ? l.quantized.key_scales : l.quantized.value_scales) = std::move(scales);
      }
    } else {
      l.key_pool = at::empty({options.pages_per_layer, options.page_size, options.head_dim}, tensor_options);
      l.value_pool = at::empty_like(l.key_pool);
    }
    l.free_pages.resize(static_cast<size_t>(options.pages_per_layer));
    // A stack taken from the back: page 0 first.
    std::iota(l.free_pages.rbegin(), l.free_pages.rend(), int64_t{0});
  }
  reserve_tables(8, 4);
}

// ---- device tables -------------------------------------------------------------------------------

void PagedKVCache::reserve_tables(int64_t slots, int64_t pages) {
  if (slots <= slot_capacity_ && pages <= page_capacity_) return;
  const int64_t new_slots = slots <= slot_capacity_ ? slot_capacity_ : std::max(slots, 2 * slot_capacity_);
  // A head never holds more than the layer's pages.
  const int64_t new_pages = pages <= page_capacity_
                                ? page_capacity_
                                : std::min(std::max(pages, 2 * page_capacity_), options_.pages_per_layer);
  detail::fault_point(detail::FaultPoint::kTableGrowth);
  const auto int64_options = at::TensorOptions().dtype(at::kLong).device(options_.device);
  // Every layer's new tables first, so that a failed allocation changes nothing.
  std::vector<std::pair<at::Tensor, at::Tensor>> grown;
  std::vector<std::pair<at::Tensor, at::Tensor>> residual;  // a quantized cache's, a page per slot and head
  for (const Layer& l : layers_) {
    at::Tensor table = at::zeros({new_slots, options_.kv_heads, new_pages}, int64_options);
    at::Tensor lengths = at::zeros({new_slots, options_.kv_heads}, int64_options);
    if (slot_capacity_ > 0) {
      table.narrow(0, 0, slot_capacity_).narrow(2, 0, page_capacity_).copy_(l.page_table);
      lengths.narrow(0, 0, slot_capacity_).copy_(l.lengths);
    }
    grown.emplace_back(std::move(table), std::move(lengths));
    if (quantized() && new_slots > slot_capacity_) {
      const auto rows = at::TensorOptions().dtype(options_.dtype).device(options_.device);
      at::Tensor keys = at::zeros({new_slots, options_.kv_heads, options_.page_size, options_.head_dim}, rows);
      at::Tensor values = at::zeros_like(keys);
      if (slot_capacity_ > 0) {
        keys.narrow(0, 0, slot_capacity_).copy_(l.quantized.residual_keys);
        values.narrow(0, 0, slot_capacity_).copy_(l.quantized.residual_values);
      }
      residual.emplace_back(std::move(keys), std::move(values));
    }
  }
  free_slots_.reserve(static_cast<size_t>(new_slots));  // free_sequence then gives a slot back without allocating
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l].page_table = std::move(grown[l].first);
    layers_[l].lengths = std::move(grown[l].second);
    if (!residual.empty()) {
      layers_[l].quantized.residual_keys = std::move(residual[l].first);
      layers_[l].quantized.residual_values = std::move(residual[l].second);
    }
  }
  for (int64_t slot = new_slots - 1; slot >= slot_capacity_; --slot) free_slots_.push_back(slot);  // lowest first
  slot_capacity_ = new_slots;
  page_capacity_ = new_pages;
}

PagedKVCache::TableUpload PagedKVCache::stage_tables(int64_t layer, const std::vector<SequenceId>& seqs,
                                                     const HeadTableStateFn& state) const {
  // One host tensor [table entries | table values | length entries | length values], one copy.
  std::vector<int64_t> table_index, table_value, length_index, length_value;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& s = sequences_.at(seqs[i]);
    for (int64_t h = 0; h < options_.kv_heads; ++h) {
      const Head& head = s.layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(h)];
      const HeadTableState after = state(i, h);
      const int64_t row = s.slot * options_.kv_heads + h;
      for (size_t j = std::min(head.synced_pages, after.page_count); j < after.page_count; ++j) {
        table_index.push_back(row * page_capacity_ + static_cast<int64_t>(j));
        table_value.push_back((*after.pages)[j]);
      }
      length_index.push_back(row);
      length_value.push_back(after.length);
    }
  }
  std::vector<int64_t> packed = table_index;
  packed.insert(packed.end(), table_value.begin(), table_value.end());
  packed.insert(packed.end(), length_index.begin(), length_index.end());
  packed.insert(packed.end(), length_value.begin(), length_value.end());
  detail::fault_point(detail::FaultPoint::kTableUpload);
  return {to_device(packed, options_.device), static_cast<int64_t>(table_index.size()),
          static_cast<int64_t>(length_index.size())};
}

void PagedKVCache::apply_tables(int64_t layer, const std::vector<SequenceId>& seqs, const TableUpload& upload) {
  Layer& l = layers_[static_cast<size_t>(layer)];
  const at::Tensor& all = upload.packed;
  const int64_t n_table = upload.n_table, n_length = upload.n_length;
  if (n_table > 0) l.page_table.view(-1).index_copy_(0, all.narrow(0, 0, n_table), all.narrow(0, n_table, n_table));
  if (n_length > 0)
    l.lengths.view(-1).index_copy_(0, all.narrow(0, 2 * n_table, n_length),
                                   all.narrow(0, 2 * n_table + n_length, n_length));
  // Marked only now: an upload that failed is sent again by the next one.
  for (SequenceId id : seqs)
    for (Head& head : sequences_.at(id).layers[static_cast<size_t>(layer)].heads) head.synced_pages = head.pages.size();
}

// ---- sequences -----------------------------------------------------------------------------------

SequenceId PagedKVCache::add_sequence() {
  Sequence s;
  s.layers.resize(static_cast<size_t>(options_.num_layers));
  for (SequenceLayer& l : s.layers) l.heads.resize(static_cast<size_t>(options_.kv_heads));
  if (free_slots_.empty()) reserve_tables(slot_capacity_ + 1, page_capacity_);
  s.slot = free_slots_.back();  // its length rows are 0: never used, or zeroed when freed
  const SequenceId id = next_id_;
  sequences_.emplace(id, std::move(s));  // the one allocation: before anything changes
  free_slots_.pop_back();
  ++next_id_;
  return id;
}

void PagedKVCache::free_sequence(SequenceId seq) {
  const int64_t slot = sequence_at(seq, "PagedKVCache::free_sequence").slot;
  reset_sequence(seq);  // pages back to the pools, length rows zeroed for the slot's next holder
  free_slots_.push_back(slot);
  sequences_.erase(seq);
}

void PagedKVCache::reset_sequence(SequenceId seq) {
  Sequence& s = sequence_at(seq, "PagedKVCache::reset_sequence");
  // Every layer's length rows become 0 (staged first: a failed upload changes nothing).
  std::vector<TableUpload> uploads;
  for (size_t l = 0; l < s.layers.size(); ++l)
    uploads.push_back(stage_tables(static_cast<int64_t>(l), {seq}, [](size_t, int64_t) {
      return HeadTableState{nullptr, 0, 0};
    }));
  for (size_t l = 0; l < s.layers.size(); ++l) {
    for (Head& h : s.layers[l].heads) {
      layers_[l].free_pages.insert(layers_[l].free_pages.end(), h.pages.rbegin(), h.pages.rend());
      h = Head{};
    }
    s.layers[l].next_position = 0;
    s.layers[l].stored = false;
    apply_tables(static_cast<int64_t>(l), {seq}, uploads[l]);
  }
}

bool PagedKVCache::contains(SequenceId seq) const { return sequences_.count(seq) != 0; }

std::vector<SequenceId> PagedKVCache::sequences() const {
  std::vector<SequenceId> ids;
  for (const auto& entry : sequences_) ids.push_back(entry.first);
  return ids;
}

const PagedKVCache::Sequence& PagedKVCache::sequence_at(SequenceId seq, const char* op) const {
  const auto it = sequences_.find(seq);
  TORCH_CHECK(it != sequences_.end(), op, ": sequence ", seq, " is not in the cache (never added, or freed)");
  return it->second;
}

PagedKVCache::Sequence& PagedKVCache::sequence_at(SequenceId seq, const char* op) {
  return const_cast<Sequence&>(static_cast<const PagedKVCache*>(this)->sequence_at(seq, op));
}

void PagedKVCache::check_layer(int64_t layer, const char* op) const {
  TORCH_CHECK(layer >= 0 && layer < options_.num_layers, op, ": layer must be in [0, ", options_.num_layers, "), got ",
              layer);
}

void PagedKVCache::check_sequences(const std::vector<SequenceId>& seqs, const char* op) const {
  TORCH_CHECK(!seqs.empty(), op, ": seqs must name at least one sequence, got none");
  std::set<SequenceId> seen;
  for (SequenceId s : seqs) {
    sequence_at(s, op);
    TORCH_CHECK(seen.insert(s).second, op, ": seqs must be distinct, got sequence ", s, " twice");
  }
}

// ---- writing -------------------------------------------------------------------------------------

class PagedKVCache::QuantizedRows {
 public:
  // Rows [count * page_size, D] of keys and values, to quantize into pages page_ids[0 .. count).
  void add_pages(const at::Tensor& keys, const at::Tensor& values, std::vector<int64_t>::const_iterator page_ids,
                 int64_t count) {
    if (count == 0) return;
    page_keys_.push_back(keys);
    page_values_.push_back(values);
    pages_.insert(pages_.end(), page_ids, page_ids + count);
  }
  // Rows [r, D] for rows first_row .. first_row + r - 1 of the flat residual tensors.
  void add_residual(const at::Tensor& keys, const at::Tensor& values, int64_t first_row) {
    if (keys.size(0) == 0) return;
    rest_keys_.push_back(keys);
    rest_values_.push_back(values);
    for (int64_t i = 0; i < keys.size(0); ++i) residual_rows_.push_back(first_row + i);
  }
  // Quantizes the pages and moves the indices to the device: everything that can fail.
  void stage(const PagedCacheOptions& o) {
    if (!pages_.empty()) {
      const auto as_pages = [&](const std::vector<at::Tensor>& rows) {
        return at::cat(rows).view({static_cast<int64_t>(pages_.size()), o.page_size, o.head_dim});
      };
      std::tie(key_codes_, key_scales_) = ops::kv_quantize(as_pages(page_keys_), o.kv_format, KVRole::kKeys);
      std::tie(value_codes_, value_scales_) = ops::kv_quantize(as_pages(page_values_), o.kv_format, KVRole::kValues);
      page_index_ = to_device(pages_, o.device);
    }
    if (!residual_rows_.empty()) {
      residual_index_ = to_device(residual_rows_, o.device);
      rest_k_ = at::cat(rest_keys_);
      rest_v_ = at::cat(rest_values_);
    }
  }
  // Writes what stage() prepared (copies that do not fail once staged).
  void apply(QuantizedPagePool& q, int64_t head_dim) const {
    if (page_index_.defined()) {
      q.key_codes.index_copy_(0, page_index_, key_codes_);
      q.key_scales.index_copy_(0, page_index_, key_scales_);
      q.value_codes.index_copy_(0, page_index_, value_codes_);
      q.value_scales.index_copy_(0, page_index_, value_scales_);
    }
    if (residual_index_.defined()) {
      q.residual_keys.view({-1, head_dim}).index_copy_(0, residual_index_, rest_k_);
      q.residual_values.view({-1, head_dim}).index_copy_(0, residual_index_, rest_v_);
    }
  }

 private:
  std::vector<at::Tensor> page_keys_, page_values_, rest_keys_, rest_values_;
  std::vector<int64_t> pages_, residual_rows_;
  at::Tensor key_codes_, key_scales_, value_codes_, value_scales_, page_index_, residual_index_, rest_k_, rest_v_;
};

void PagedKVCache::write(int64_t layer, const std::vector<SequenceId>& seqs, std::vector<HeadWrite>& writes) {
  Layer& pool = layers_[static_cast<size_t>(layer)];
  const int64_t page_size = options_.page_size;
  // The page lists after the write, computed first so that nothing changes when pages run out.
  std::vector<std::vector<int64_t>> new_pages(writes.size());
  int64_t needed = 0;
  for (size_t w = 0; w < writes.size(); ++w) {
    const Head& head = sequences_.at(seqs[static_cast<size_t>(writes[w].seq_index)])
                           .layers[static_cast<size_t>(layer)]
                           .heads[static_cast<size_t>(writes[w].head)];
    const int64_t total = static_cast<int64_t>(head.positions.size() + writes[w].positions.size());
    needed += std::max<int64_t>(0, table_pages(total) - static_cast<int64_t>(head.pages.size()));
  }
  const int64_t available = static_cast<int64_t>(pool.free_pages.size());
  TORCH_CHECK(needed <= available, "PagedKVCache: out of pages at layer ", layer, ": the write needs ", needed,
              " new pages of ", page_size, " tokens, ", available, " are free (pages_per_layer ",
              options_.pages_per_layer, "); nothing was written");
  size_t taken = 0;  // pages taken from the back of the free stack
  std::vector<int64_t> slots;
  std::vector<at::Tensor> key_rows, value_rows;
  for (size_t w = 0; w < writes.size(); ++w) {
    const Head& head = sequences_.at(seqs[static_cast<size_t>(writes[w].seq_index)])
                           .layers[static_cast<size_t>(layer)]
                           .heads[static_cast<size_t>(writes[w].head)];
    std::vector<int64_t>& pages = new_pages[w];
    pages = head.pages;
    const auto length = static_cast<int64_t>(head.positions.size());
    const auto n = static_cast<int64_t>(writes[w].positions.size());
    while (static_cast<int64_t>(pages.size()) < table_pages(length + n)) {
      detail::fault_point(detail::FaultPoint::kPageTaking);
      pages.push_back(pool.free_pages[pool.free_pages.size() - 1 - taken++]);
    }
    if (quantized()) continue;
    for (int64_t t = length; t < length + n; ++t)
      slots.push_back(pages[static_cast<size_t>(t / page_size)] * page_size + t % page_size);
    key_rows.push_back(writes[w].keys);
    value_rows.push_back(writes[w].values);
  }
  int64_t most_pages = 0;
  for (const auto& pages : new_pages) most_pages = std::max(most_pages, static_cast<int64_t>(pages.size()));
  reserve_tables(slot_capacity_, most_pages);
  const QuantizedRows quantized_rows = quantized() ? quantized_write(layer, seqs, writes, new_pages) : QuantizedRows{};
  // The tables after the write, staged before anything changes.
  std::vector<int64_t> write_of(seqs.size() * static_cast<size_t>(options_.kv_heads), -1);  // (seq, head) -> w
  for (size_t w = 0; w < writes.size(); ++w)
    write_of[static_cast<size_t>(writes[w].seq_index * options_.kv_heads + writes[w].head)] = static_cast<int64_t>(w);
  const TableUpload upload = stage_tables(layer, seqs, [&](size_t i, int64_t h) {
    const Head& head = sequences_.at(seqs[i]).layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(h)];
    const int64_t w = write_of[i * static_cast<size_t>(options_.kv_heads) + static_cast<size_t>(h)];
    if (w < 0) return HeadTableState{&head.pages, head.pages.size(), static_cast<int64_t>(head.positions.size())};
    const std::vector<int64_t>& pages = new_pages[static_cast<size_t>(w)];
    return HeadTableState{
        &pages, pages.size(),
        static_cast<int64_t>(head.positions.size() + writes[static_cast<size_t>(w)].positions.size())};
  });
  if (quantized()) {
    // The pages that fill are free until the commit; residual rows that fill a page are in it by now.
    quantized_rows.apply(pool.quantized, options_.head_dim);
  } else if (!slots.empty()) {
    const at::Tensor keys = at::cat(key_rows), values = at::cat(value_rows);
    ops::paged_write(pool.key_pool, pool.value_pool, keys, values, to_device(slots, options_.device));
  }
  // Room for the new positions, so that the commit allocates nothing and cannot fail half-way.
  for (const HeadWrite& hw : writes) {
    std::vector<int64_t>& positions = sequences_.at(seqs[static_cast<size_t>(hw.seq_index)])
                                          .layers[static_cast<size_t>(layer)]
                                          .heads[static_cast<size_t>(hw.head)]
                                          .positions;
    const size_t needed = positions.size() + hw.positions.size();
    if (positions.capacity() < needed) positions.reserve(std::max(needed, 2 * positions.capacity()));
  }
  // Commit.
  pool.free_pages.resize(pool.free_pages.size() - taken);
  for (size_t w = 0; w < writes.size(); ++w) {
    Head& head = sequences_.at(seqs[static_cast<size_t>(writes[w].seq_index)])
                     .layers[static_cast<size_t>(layer)]
                     .heads[static_cast<size_t>(writes[w].head)];
    head.pages = std::move(new_pages[w]);
    head.positions.insert(head.positions.end(), writes[w].positions.begin(), writes[w].positions.end());
  }
  apply_tables(layer, seqs, upload);
  peak_pages_used_ = std::max(peak_pages_used_, pages_used_now());
}

PagedKVCache::QuantizedRows PagedKVCache::quantized_write(int64_t layer, const std::vector<SequenceId>& seqs,
                                                          const std::vector<HeadWrite>& writes,
                                                          const std::vector<std::vector<int64_t>>& new_pages) const {
  const QuantizedPagePool& q = layers_[static_cast<size_t>(layer)].quantized;
  const int64_t page_size = options_.page_size, dim = options_.head_dim;
  QuantizedRows rows;
  for (size_t w = 0; w < writes.size(); ++w) {
    const HeadWrite& hw = writes[w];
    const Sequence& s = sequences_.at(seqs[static_cast<size_t>(hw.seq_index)]);
    const Head& head = s.layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(hw.head)];
    const auto length = static_cast<int64_t>(head.positions.size());
    const int64_t full = length / page_size, residual = length % page_size;
    const int64_t first_row = (s.slot * options_.kv_heads + hw.head) * page_size;
    // The head's residual rows, then the new rows (copies: the residual rows are rewritten after).
    const at::Tensor k = at::cat({q.residual_keys.view({-1, dim}).narrow(0, first_row, residual), hw.keys});
    const at::Tensor v = at::cat({q.residual_values.view({-1, dim}).narrow(0, first_row, residual), hw.values});
    const int64_t filled = static_cast<int64_t>(new_pages[w].size()) - full;  // pages that fill
    rows.add_pages(k.narrow(0, 0, filled * page_size), v.narrow(0, 0, filled * page_size), new_pages[w].begin() + full,
                   filled);
    const int64_t rest = k.size(0) - filled * page_size;
    rows.add_residual(k.narrow(0, filled * page_size, rest), v.narrow(0, filled * page_size, rest), first_row);
  }
  rows.stage(options_);
  return rows;
}

int64_t PagedKVCache::table_pages(int64_t length) const {
  return kernels::table_pages(quantized(), length, options_.page_size);
}

void PagedKVCache::store(int64_t layer, const std::vector<SequenceId>& seqs, const at::Tensor& keys,
                         const at::Tensor& values, const at::Tensor& cu_seqlens, const BasePress* press,
                         const SequenceInputsFn& inputs) {
  constexpr const char* op = "PagedKVCache::store";
  checks::check_rank(op, "keys", keys, 3, "[total_tokens, kv_heads, head_dim]");
  checks::check_rank(op, "values", values, 3, "[total_tokens, kv_heads, head_dim]");
  checks::check_rank(op, "cu_seqlens", cu_seqlens, 1, "[batch + 1]");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
  TORCH_CHECK(cu_seqlens.size(0) == static_cast<int64_t>(seqs.size()) + 1, op, ": cu_seqlens must be [",
              seqs.size() + 1, "] (batch + 1 offsets for ", seqs.size(), " sequences), got ", shape_str(cu_seqlens));
  const std::vector<int64_t> cu = to_host_vector(cu_seqlens);
  TORCH_CHECK(cu.front() == 0 && cu.back() == keys.size(0), op, ": cu_seqlens must run from 0 to total_tokens (",
              keys.size(0), "), got ", cu.front(), " .. ", cu.back());
  std::vector<at::Tensor> k, v;
  for (size_t i = 0; i + 1 < cu.size(); ++i) {
    TORCH_CHECK(cu[i + 1] > cu[i], op, ": every sequence must hold at least one token, got cu_seqlens[", i + 1,
                "] = ", cu[i + 1], " after cu_seqlens[", i, "] = ", cu[i]);
    // [len, Hkv, D] -> [1, Hkv, len, D] views.
    k.push_back(keys.narrow(0, cu[i], cu[i + 1] - cu[i]).permute({1, 0, 2}).unsqueeze(0));
    v.push_back(values.narrow(0, cu[i], cu[i + 1] - cu[i]).permute({1, 0, 2}).unsqueeze(0));
  }
  store_views(layer, seqs, k, v, press, inputs, op);
}

void PagedKVCache::store_padded(int64_t layer, const std::vector<SequenceId>& seqs, const at::Tensor& keys,
                                const at::Tensor& values, const at::Tensor& lengths, const BasePress* press,
                                const SequenceInputsFn& inputs) {
  constexpr const char* op = "PagedKVCache::store_padded";
  checks::check_rank(op, "keys", keys, 4, "[batch, kv_heads, seq_len, head_dim]");
  checks::check_rank(op, "values", values, 4, "[batch, kv_heads, seq_len, head_dim]");
  checks::check_rank(op, "lengths", lengths, 1, "[batch]");
  TORCH_CHECK(!at::isFloatingType(lengths.scalar_type()) && lengths.scalar_type() != at::kBool, op,
              ": lengths must be an integer tensor, got ", lengths.scalar_type());
  TORCH_CHECK(keys.size(0) == static_cast<int64_t>(seqs.size()) && lengths.size(0) == keys.size(0), op,
              ": keys and lengths must have one row per sequence (", seqs.size(), "), got keys ", shape_str(keys),
              " and lengths ", shape_str(lengths));
  const std::vector<int64_t> len = to_host_vector(lengths);
  std::vector<at::Tensor> k, v;
  for (size_t i = 0; i < len.size(); ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= keys.size(2), op, ": lengths must be in [1, seq_len (", keys.size(2),
                ")], got ", len[i], " for sequence ", i);
    k.push_back(keys.narrow(0, static_cast<int64_t>(i), 1).narrow(2, 0, len[i]));
    v.push_back(values.narrow(0, static_cast<int64_t>(i), 1).narrow(2, 0, len[i]));
  }
  store_views(layer, seqs, k, v, press, inputs, op);
}

void PagedKVCache::store_views(int64_t layer, const std::vector<SequenceId>& seqs, const std::vector<at::Tensor>& keys,
                               const std::vector<at::Tensor>& values, const BasePress* press,
                               const SequenceInputsFn& inputs, const char* op) {
  check_layer(layer, op);
  check_sequences(seqs, op);
  const int64_t kv_heads = options_.kv_heads, dim = options_.head_dim;
  for (size_t i = 0; i < seqs.size(); ++i) {
    TORCH_CHECK(!sequences_.at(seqs[i]).layers[static_cast<size_t>(layer)].stored, op, ": sequence ", seqs[i],
                " already holds layer ", layer, " (store() writes a prefill into an empty layer)");
    const at::Tensor& k = keys[i];
    TORCH_CHECK(k.size(1) == kv_heads && k.size(3) == dim && values[i].sizes() == k.sizes(), op,
                ": keys and values must have ", kv_heads, " KV heads of dimension ", dim, " like the cache, got ",
                shape_str(k), " and ", shape_str(values[i]), " for sequence ", i);
    for (const at::Tensor* t : {&k, &values[i]}) {
      TORCH_CHECK(t->scalar_type() == options_.dtype, op, ": keys and values must be ", options_.dtype,
                  " like the cache, got ", t->scalar_type());
      TORCH_CHECK(t->device() == options_.device, op, ": keys and values must be on ", options_.device,
                  " like the cache, got ", t->device());
    }
  }
  // Select every sequence's tokens before writing anything, so that a press failing on sequence i
  // leaves the cache as it was.
  std::vector<HeadWrite> writes;
  std::vector<int64_t> next_positions;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t seq_len = keys[i].size(2);
    const auto index = static_cast<int64_t>(i);
    if (press == nullptr) {
      std::vector<int64_t> all(static_cast<size_t>(seq_len));
      std::iota(all.begin(), all.end(), int64_t{0});
      for (int64_t h = 0; h < kv_heads; ++h) writes.push_back({index, h, keys[i][0][h], values[i][0][h], all});
      next_positions.push_back(seq_len);
      continue;
    }
    LayerInputs in;
    in.layer_idx = layer;
    in.num_layers = options_.num_layers;
    if (inputs) inputs(index, in);
    in.keys = keys[i];  // the cache's rows, whatever the callback set
    in.values = values[i];
    const RaggedKV kv = press->compress_ragged(in);
    TORCH_CHECK(kv.batch == 1 && kv.kv_heads == kv_heads && static_cast<int64_t>(kv.heads.size()) == kv_heads, op, ": ",
                press->name(), " returned ", kv.batch, " x ", kv.kv_heads, " heads for one sequence of ", kv_heads);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const HeadKV& head = kv.at(0, h);
      writes.push_back({index, h, head.keys, head.values, to_host_vector(head.kept_indices)});
    }
    next_positions.push_back(press->position_after(seq_len, kv.at(0, 0).kept_indices.size(0)));
  }
  write(layer, seqs, writes);
  for (size_t i = 0; i < seqs.size(); ++i) {
    SequenceLayer& l = sequences_.at(seqs[i]).layers[static_cast<size_t>(layer)];
    l.stored = true;
    l.next_position = next_positions[i];
  }
}

void PagedKVCache::append(int64_t layer, const std::vector<SequenceId>& seqs, const at::Tensor& keys,
                          const at::Tensor& values) {
  constexpr const char* op = "PagedKVCache::append";
  check_layer(layer, op);
  check_sequences(seqs, op);
  checks::check_kv(op, keys, values);
  TORCH_CHECK(keys.size(0) == static_cast<int64_t>(seqs.size()) && keys.size(1) == options_.kv_heads &&
                  keys.size(3) == options_.head_dim,
              op, ": keys must be [", seqs.size(), ", ", options_.kv_heads, ", n, ", options_.head_dim,
              "] (one row per sequence), got ", shape_str(keys));
  TORCH_CHECK(keys.scalar_type() == options_.dtype && keys.device() == options_.device, op, ": keys must be ",
              options_.dtype, " on ", options_.device, " like the cache, got ", keys.scalar_type(), " on ",
              keys.device());
  const int64_t n = keys.size(2);
  std::vector<HeadWrite> writes;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t next = sequences_.at(seqs[i]).layers[static_cast<size_t>(layer)].next_position;
    std::vector<int64_t> positions(static_cast<size_t>(n));
    std::iota(positions.begin(), positions.end(), next);
    for (int64_t h = 0; h < options_.kv_heads; ++h)
      writes.push_back({static_cast<int64_t>(i), h, keys[static_cast<int64_t>(i)][h],
                        values[static_cast<int64_t>(i)][h], positions});
  }
  write(layer, seqs, writes);
  for (SequenceId s : seqs) {
    SequenceLayer& l = sequences_.at(s).layers[static_cast<size_t>(layer)];
    l.stored = true;
    l.next_position += n;
  }
}

int64_t PagedKVCache::pages_to_append(int64_t layer, const std::vector<SequenceId>& seqs, int64_t n) const {
  constexpr const char* op = "PagedKVCache::pages_to_append";
  check_layer(layer, op);
  check_sequences(seqs, op);
  checks::check_non_negative(op, "n", n);
  int64_t pages = 0;
  for (SequenceId s : seqs)
    for (const Head& h : sequences_.at(s).layers[static_cast<size_t>(layer)].heads)
      pages += table_pages(static_cast<int64_t>(h.positions.size()) + n) - static_cast<int64_t>(h.pages.size());
  return pages;
}

void PagedKVCache::remove_last(int64_t layer, const std::vector<SequenceId>& seqs, int64_t n) {
  constexpr const char* op = "PagedKVCache::remove_last";
  check_layer(layer, op);
  check_sequences(seqs, op);
  checks::check_non_negative(op, "n", n);
  for (SequenceId s : seqs)
    for (const Head& h : sequences_.at(s).layers[static_cast<size_t>(layer)].heads)
      TORCH_CHECK(static_cast<int64_t>(h.positions.size()) >= n, op, ": sequence ", s, " holds ", h.positions.size(),
                  " tokens in a head of layer ", layer, ", fewer than the ", n, " to remove");
  const auto pages_for = [&](int64_t tokens) { return static_cast<size_t>(table_pages(tokens)); };
  const QuantizedRows reopened = reopened_rows(layer, seqs, n);
  const TableUpload upload = stage_tables(layer, seqs, [&](size_t i, int64_t h) {
    const Head& head = sequences_.at(seqs[i]).layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(h)];
    const int64_t length = static_cast<int64_t>(head.positions.size()) - n;
    return HeadTableState{&head.pages, pages_for(length), length};
  });
  Layer& pool = layers_[static_cast<size_t>(layer)];
  if (quantized()) reopened.apply(pool.quantized, options_.head_dim);
  for (SequenceId s : seqs) {
    SequenceLayer& sl = sequences_.at(s).layers[static_cast<size_t>(layer)];
    for (Head& h : sl.heads) {
      h.positions.resize(h.positions.size() - static_cast<size_t>(n));
      const auto keep = pages_for(static_cast<int64_t>(h.positions.size()));
      pool.free_pages.insert(pool.free_pages.end(), h.pages.rbegin(),
                             h.pages.rbegin() + static_cast<std::ptrdiff_t>(h.pages.size() - keep));
      h.pages.resize(keep);
    }
    sl.next_position -= n;
  }
  apply_tables(layer, seqs, upload);
}

PagedKVCache::QuantizedRows PagedKVCache::reopened_rows(int64_t layer, const std::vector<SequenceId>& seqs,
                                                        int64_t n) const {
  QuantizedRows rows;
  if (!quantized()) return rows;
  const int64_t page_size = options_.page_size;
  for (SequenceId id : seqs) {
    const Sequence& s = sequences_.at(id);
    for (int64_t h = 0; h < options_.kv_heads; ++h) {
      const Head& head = s.layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(h)];
      const int64_t after = static_cast<int64_t>(head.positions.size()) - n;
      // Only a page that was full before and holds tokens after is reopened.
      if (after / page_size >= static_cast<int64_t>(head.pages.size()) || after % page_size == 0) continue;
      const int64_t first = after / page_size * page_size;
      rows.add_residual(head_rows(layer, id, {h}, true).narrow(0, first, after - first),
                        head_rows(layer, id, {h}, false).narrow(0, first, after - first),
                        (s.slot * options_.kv_heads + h) * page_size);
    }
  }
  rows.stage(options_);
  return rows;
}

PagedKVCache::QuantizedRows PagedKVCache::compacted_rows(int64_t layer, SequenceId seq,
                                                         const std::vector<std::vector<int64_t>>& kept) const {
  const Sequence& s = sequences_.at(seq);
  const int64_t page_size = options_.page_size;
  QuantizedRows rows;
  for (int64_t h = 0; h < options_.kv_heads; ++h) {
    const Head& head = s.layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(h)];
    const std::vector<int64_t>& k = kept[static_cast<size_t>(h)];
    const auto count = static_cast<int64_t>(k.size());
    int64_t first_moved = 0;
    while (first_moved < count && k[static_cast<size_t>(first_moved)] == first_moved) ++first_moved;
    const int64_t full = count / page_size, unchanged = std::min(first_moved / page_size, full);
    // Nothing moved and the residual rows stay residual rows: the head keeps its storage.
    if (first_moved == count && full == static_cast<int64_t>(head.pages.size())) continue;
    const at::Tensor index = to_device(std::vector<int64_t>(k.begin(), k.end()), options_.device);
    const at::Tensor keys = head_rows(layer, seq, {h}, true).index_select(0, index);
    const at::Tensor values = head_rows(layer, seq, {h}, false).index_select(0, index);
    const int64_t from = unchanged * page_size, to = full * page_size;
    rows.add_pages(keys.narrow(0, from, to - from), values.narrow(0, from, to - from), head.pages.begin() + unchanged,
                   full - unchanged);
    rows.add_residual(keys.narrow(0, to, count - to), values.narrow(0, to, count - to),
                      (s.slot * options_.kv_heads + h) * page_size);
  }
  rows.stage(options_);
  return rows;
}

// ---- reading -------------------------------------------------------------------------------------

PagedBatchView PagedKVCache::batch_view(int64_t layer, const std::vector<SequenceId>& seqs) const {
  constexpr const char* op = "PagedKVCache::batch_view";
  check_layer(layer, op);
  check_sequences(seqs, op);
  std::vector<int64_t> slots;
  int64_t max_pages = 1;
  for (SequenceId id : seqs) {
    const Sequence& s = sequences_.at(id);
    slots.push_back(s.slot);
    for (const Head& h : s.layers[static_cast<size_t>(layer)].heads)
      max_pages = std::max(max_pages, static_cast<int64_t>(h.pages.size()));
  }
  const Layer& l = layers_[static_cast<size_t>(layer)];
  const at::Tensor rows = to_device(slots, options_.device);
  return {l.page_table.narrow(2, 0, max_pages).index_select(0, rows), l.lengths.index_select(0, rows), rows};
}

at::Tensor PagedKVCache::attention(int64_t layer, const std::vector<SequenceId>& seqs, const at::Tensor& queries,
                                   std::optional<double> scale) const {
  constexpr const char* op = "PagedKVCache::attention";
  checks::check_rank(op, "queries", queries, 4, "[batch, q_heads, n, head_dim]");
  TORCH_CHECK(queries.size(0) == static_cast<int64_t>(seqs.size()), op, ": queries must have one row per sequence (",
              seqs.size(), "), got ", shape_str(queries));
  const PagedBatchView view = batch_view(layer, seqs);
  const Layer& pool = layers_[static_cast<size_t>(layer)];
  if (quantized()) {
    const QuantizedPagePool& q = pool.quantized;
    return ops::paged_attention_quantized(queries, q.key_codes, q.key_scales, q.value_codes, q.value_scales,
                                          options_.kv_format, view.page_table, view.lengths, q.residual_keys,
                                          q.residual_values, view.slots, scale);
  }
  return ops::paged_attention(queries, pool.key_pool, pool.value_pool, view.page_table, view.lengths, scale);
}

int64_t PagedKVCache::length(SequenceId seq, int64_t layer, int64_t head) const {
  return static_cast<int64_t>(positions(seq, layer, head).size());
}

std::vector<int64_t> PagedKVCache::lengths(SequenceId seq, int64_t layer) const {
  constexpr const char* op = "PagedKVCache::lengths";
  check_layer(layer, op);
  std::vector<int64_t> out;
  for (const Head& h : sequence_at(seq, op).layers[static_cast<size_t>(layer)].heads)
    out.push_back(static_cast<int64_t>(h.positions.size()));
  return out;
}

int64_t PagedKVCache::next_position(SequenceId seq, int64_t layer) const {
  constexpr const char* op = "PagedKVCache::next_position";
  check_layer(layer, op);
  return sequence_at(seq, op).layers[static_cast<size_t>(layer)].next_position;
}

std::vector<int64_t> PagedKVCache::positions(SequenceId seq, int64_t layer, int64_t head) const {
  constexpr const char* op = "PagedKVCache::positions";
  check_layer(layer, op);
  TORCH_CHECK(head >= 0 && head < options_.kv_heads, op, ": head must be in [0, ", options_.kv_heads, "), got ", head);
  return sequence_at(seq, op).layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(head)].positions;
}

const std::vector<int64_t>& PagedKVCache::pages(SequenceId seq, int64_t layer, int64_t head) const {
  constexpr const char* op = "PagedKVCache::pages";
  check_layer(layer, op);
  TORCH_CHECK(head >= 0 && head < options_.kv_heads, op, ": head must be in [0, ", options_.kv_heads, "), got ", head);
  return sequence_at(seq, op).layers[static_cast<size_t>(layer)].heads[static_cast<size_t>(head)].pages;
}

namespace {

// Pool slots of a head's first `n` tokens.
std::vector<int64_t> head_slots(const std::vector<int64_t>& pages, int64_t n, int64_t page_size) {
  std::vector<int64_t> slots(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t)
    slots[static_cast<size_t>(t)] = pages[static_cast<size_t>(t / page_size)] * page_size + t % page_size;
  return slots;
}

}  // namespace

at::Tensor PagedKVCache::head_rows(int64_t layer, SequenceId seq, const std::vector<int64_t>& heads, bool keys) const {
  const SequenceLayer& sl = sequences_.at(seq).layers[static_cast<size_t>(layer)];
  const Layer& pool = layers_[static_cast<size_t>(layer)];
  const int64_t page_size = options_.page_size, dim = options_.head_dim;
  if (!quantized()) {
    std::vector<int64_t> slots;
    for (int64_t h : heads) {
      const Head& head = sl.heads[static_cast<size_t>(h)];
      const std::vector<int64_t> s = head_slots(head.pages, static_cast<int64_t>(head.positions.size()), page_size);
      slots.insert(slots.end(), s.begin(), s.end());
    }
    return (keys ? pool.key_pool : pool.value_pool).view({-1, dim}).index_select(0, to_device(slots, options_.device));
  }
  // Every head's full pages dequantized at once, then each head's share followed by its residual rows.
  const QuantizedPagePool& q = pool.quantized;
  std::vector<int64_t> pages;
  for (int64_t h : heads) {
    const std::vector<int64_t>& p = sl.heads[static_cast<size_t>(h)].pages;
    pages.insert(pages.end(), p.begin(), p.end());
  }
  const at::Tensor index = to_device(pages, options_.device);
  const at::Tensor dequantized = ops::kv_dequantize((keys ? q.key_codes : q.value_codes).index_select(0, index),
                                                    (keys ? q.key_scales : q.value_scales).index_select(0, index),
                                                    options_.kv_format, keys ? KVRole::kKeys : KVRole::kValues, dim)
                                     .to(options_.dtype)
                                     .view({static_cast<int64_t>(pages.size()) * page_size, dim});
  const at::Tensor residual = (keys ? q.residual_keys : q.residual_values).view({-1, dim});
  const int64_t slot = sequences_.at(seq).slot;
  std::vector<at::Tensor> parts;
  int64_t row = 0;
  for (int64_t h : heads) {
    const Head& head = sl.heads[static_cast<size_t>(h)];
    const auto full = static_cast<int64_t>(head.pages.size()) * page_size;
    parts.push_back(dequantized.narrow(0, row, full));
    parts.push_back(residual.narrow(0, (slot * options_.kv_heads + h) * page_size,
                                    static_cast<int64_t>(head.positions.size()) - full));
    row += full;
  }
  return at::cat(parts);
}

at::Tensor PagedKVCache::head_keys(SequenceId seq, int64_t layer, int64_t head) const {
  pages(seq, layer, head);  // checks seq, layer and head
  return head_rows(layer, seq, {head}, true);
}

at::Tensor PagedKVCache::head_values(SequenceId seq, int64_t layer, int64_t head) const {
  pages(seq, layer, head);
  return head_rows(layer, seq, {head}, false);
}

std::pair<at::Tensor, at::Tensor> PagedKVCache::dense(SequenceId seq, int64_t layer) const {
  constexpr const char* op = "PagedKVCache::dense";
  const std::vector<int64_t> len = lengths(seq, layer);
  TORCH_CHECK(std::all_of(len.begin(), len.end(), [&](int64_t l) { return l == len.front(); }) && len.front() > 0, op,
              ": every head of sequence ", seq, " at layer ", layer,
              " must hold the same non-zero number of tokens for a dense copy, got ", c10::Join(", ", len));
  std::vector<int64_t> heads(static_cast<size_t>(options_.kv_heads));
  std::iota(heads.begin(), heads.end(), int64_t{0});
  const std::vector<int64_t> shape{1, options_.kv_heads, len.front(), options_.head_dim};
  return {head_rows(layer, seq, heads, true).view(shape), head_rows(layer, seq, heads, false).view(shape)};
}

// ---- moving a sequence between caches ------------------------------------------------------------

int64_t SequenceTokens::tokens() const { return std::accumulate(lengths.begin(), lengths.end(), int64_t{0}); }

SequenceTokens PagedKVCache::export_sequence(SequenceId seq) const {
  const Sequence& s = sequence_at(seq, "PagedKVCache::export_sequence");
  SequenceTokens out;
  out.num_layers = options_.num_layers;
  out.kv_heads = options_.kv_heads;
  out.head_dim = options_.head_dim;
  out.dtype = options_.dtype;
  std::vector<int64_t> positions;
  for (const SequenceLayer& sl : s.layers)
    for (const Head& head : sl.heads) {
      positions.insert(positions.end(), head.positions.begin(), head.positions.end());
      out.lengths.push_back(static_cast<int64_t>(head.positions.size()));
    }
  const auto total = static_cast<int64_t>(positions.size());
  out.positions = at::tensor(at::ArrayRef<int64_t>(positions), at::kLong);
  out.keys = at::empty({total, options_.head_dim}, at::TensorOptions().dtype(options_.dtype).device(options_.device));
  out.values = at::empty_like(out.keys);
  int64_t row = 0;  // the next row of out.keys
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    const SequenceLayer& sl = s.layers[static_cast<size_t>(l)];
    out.next_positions.push_back(sl.next_position);
    int64_t n = 0;
    for (const Head& head : sl.heads) n += static_cast<int64_t>(head.positions.size());
    if (n == 0) continue;
    std::vector<int64_t> heads(static_cast<size_t>(options_.kv_heads));
    std::iota(heads.begin(), heads.end(), int64_t{0});
    out.keys.narrow(0, row, n).copy_(head_rows(l, seq, heads, true));
    out.values.narrow(0, row, n).copy_(head_rows(l, seq, heads, false));
    row += n;
  }
  return out;
}

namespace {

// adopt_sequence's checks of `t` against a cache's options.
void check_sequence_tokens(const SequenceTokens& t, const PagedCacheOptions& o) {
  constexpr const char* op = "PagedKVCache::adopt_sequence";
  TORCH_CHECK(
      t.num_layers == o.num_layers && t.kv_heads == o.kv_heads && t.head_dim == o.head_dim && t.dtype == o.dtype, op,
      ": tokens must come from a cache of ", o.num_layers, " layers, ", o.kv_heads, " KV heads, head_dim ", o.head_dim,
      " and ", o.dtype, " like this one, got ", t.num_layers, " layers, ", t.kv_heads, " KV heads, head_dim ",
      t.head_dim, " and ", t.dtype);
  TORCH_CHECK(t.lengths.size() == static_cast<size_t>(o.num_layers * o.kv_heads) &&
                  t.next_positions.size() == static_cast<size_t>(o.num_layers),
              op, ": tokens.lengths must hold num_layers * kv_heads (", o.num_layers * o.kv_heads,
              ") entries and tokens.next_positions num_layers (", o.num_layers, "), got ", t.lengths.size(), " and ",
              t.next_positions.size());
  for (size_t i = 0; i < t.lengths.size(); ++i)
    TORCH_CHECK(t.lengths[i] >= 0, op, ": tokens.lengths must be >= 0, got ", t.lengths[i], " at entry ", i);
  const int64_t n = t.tokens();
  TORCH_CHECK(t.positions.defined() && t.positions.dim() == 1 && t.positions.size(0) == n &&
                  t.positions.scalar_type() == at::kLong,
              op, ": tokens.positions must be [", n, "] int64 (one per token), got ",
              t.positions.defined() ? shape_str(t.positions) : std::string("undefined"));
  for (const at::Tensor* kv : {&t.keys, &t.values})
    TORCH_CHECK(kv->defined() && kv->dim() == 2 && kv->size(0) == n && kv->size(1) == o.head_dim &&
                    kv->scalar_type() == o.dtype,
                op, ": tokens.keys and tokens.values must be [", n, ", ", o.head_dim, "] ", o.dtype, ", got ",
                kv->defined() ? shape_str(*kv) : std::string("undefined"));
}

}  // namespace

SequenceId PagedKVCache::adopt_sequence(const SequenceTokens& tokens) {
  constexpr const char* op = "PagedKVCache::adopt_sequence";
  check_sequence_tokens(tokens, options_);
  const int64_t kv_heads = options_.kv_heads;
  for (int64_t l = 0; l < options_.num_layers; ++l) {  // every layer's pages, before any is taken
    int64_t needed = 0;
    for (int64_t h = 0; h < kv_heads; ++h) needed += table_pages(tokens.lengths[static_cast<size_t>(l * kv_heads + h)]);
    TORCH_CHECK(needed <= free_pages(l), op, ": out of pages at layer ", l, ": the sequence needs ", needed,
                " pages of ", options_.page_size, " tokens, ", free_pages(l), " are free; nothing was adopted");
  }
  const at::Tensor positions = tokens.positions.contiguous();
  const int64_t* position = positions.const_data_ptr<int64_t>();
  const at::Tensor keys = tokens.keys.to(options_.device), values = tokens.values.to(options_.device);
  const SequenceId seq = add_sequence();
  try {
    int64_t first = 0;  // the layer's first row in tokens
    for (int64_t l = 0; l < options_.num_layers; ++l) {
      std::vector<HeadWrite> writes;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t n = tokens.lengths[static_cast<size_t>(l * kv_heads + h)];
        if (n == 0) continue;
        writes.push_back({0, h, keys.narrow(0, first, n), values.narrow(0, first, n),
                          std::vector<int64_t>(position + first, position + first + n)});
        first += n;
      }
      write(l, {seq}, writes);
      SequenceLayer& sl = sequences_.at(seq).layers[static_cast<size_t>(l)];
      sl.next_position = tokens.next_positions[static_cast<size_t>(l)];
      sl.stored = sl.next_position > 0 || !writes.empty();
    }
  } catch (...) {
    free_sequence(seq);  // the layers written so far go back to the pools
    throw;
  }
  return seq;
}

// ---- compaction ----------------------------------------------------------------------------------

struct PagedKVCache::StagedCompaction {
  int64_t layer;
  SequenceId seq;
  std::vector<std::vector<int64_t>> kept;             // per head, the kept tokens' indices
  QuantizedRows rewritten;                            // a quantized cache's pages written again
  at::Tensor moved_keys, moved_values, destinations;  // a full cache's rows that change slot
  TableUpload upload;
};

PagedKVCache::StagedCompaction PagedKVCache::stage_compaction(int64_t layer, SequenceId seq,
                                                              const at::Tensor& keep_mask) const {
  constexpr const char* op = "PagedKVCache::compact";
  check_layer(layer, op);
  const SequenceLayer& sl = sequence_at(seq, op).layers[static_cast<size_t>(layer)];
  checks::check_rank(op, "keep_mask", keep_mask, 2, "[kv_heads, length]");
  TORCH_CHECK(keep_mask.scalar_type() == at::kBool, op, ": keep_mask must be bool, got ", keep_mask.scalar_type());
  const std::vector<int64_t> len = lengths(seq, layer);
  const int64_t longest = *std::max_element(len.begin(), len.end());
  TORCH_CHECK(keep_mask.size(0) == options_.kv_heads && keep_mask.size(1) >= longest, op, ": keep_mask must be [",
              options_.kv_heads, ", L >= ", longest, "] (the longest head), got ", shape_str(keep_mask));
  const at::Tensor mask = keep_mask.to(at::kCPU).contiguous();
  const bool* m = mask.const_data_ptr<bool>();
  const int64_t width = mask.size(1), page_size = options_.page_size;

  std::vector<std::vector<int64_t>> kept(static_cast<size_t>(options_.kv_heads));
  for (int64_t h = 0; h < options_.kv_heads; ++h) {
    for (int64_t t = len[static_cast<size_t>(h)]; t < width; ++t)
      TORCH_CHECK(!m[h * width + t], op, ": keep_mask must be false past head ", h, "'s ", len[static_cast<size_t>(h)],
                  " tokens, got true at ", t);
    for (int64_t t = 0; t < len[static_cast<size_t>(h)]; ++t)
      if (m[h * width + t]) kept[static_cast<size_t>(h)].push_back(t);
  }
  // Rows whose slot changes: kept token k_j moves to index j (k_j >= j, so gathering every source
  // before writing is enough; no full copy of the head).
  std::vector<int64_t> sources, destinations;
  for (int64_t h = 0; h < options_.kv_heads && !quantized(); ++h) {
    const Head& head = sl.heads[static_cast<size_t>(h)];
    const std::vector<int64_t>& k = kept[static_cast<size_t>(h)];
    const auto slot = [&](int64_t t) {
      return head.pages[static_cast<size_t>(t / page_size)] * page_size + t % page_size;
    };
    for (size_t j = 0; j < k.size(); ++j) {
      if (k[j] == static_cast<int64_t>(j)) continue;
      sources.push_back(slot(k[j]));
      destinations.push_back(slot(static_cast<int64_t>(j)));
    }
  }
  StagedCompaction staged{layer, seq, {}, quantized() ? compacted_rows(layer, seq, kept) : QuantizedRows{},
                          {},    {},  {}, {}};
  if (!sources.empty()) {
    const Layer& pool = layers_[static_cast<size_t>(layer)];
    const at::Tensor src = to_device(sources, options_.device);
    staged.moved_keys = pool.key_pool.view({-1, options_.head_dim}).index_select(0, src);
    staged.moved_values = pool.value_pool.view({-1, options_.head_dim}).index_select(0, src);
    staged.destinations = to_device(destinations, options_.device);
  }
  staged.upload = stage_tables(layer, {seq}, [&](size_t, int64_t h) {
    const Head& head = sl.heads[static_cast<size_t>(h)];
    const auto length = static_cast<int64_t>(kept[static_cast<size_t>(h)].size());
    return HeadTableState{&head.pages, static_cast<size_t>(table_pages(length)), length};
  });
  staged.kept = std::move(kept);
  return staged;
}

void PagedKVCache::apply_compaction(const StagedCompaction& staged) {
  Layer& pool = layers_[static_cast<size_t>(staged.layer)];
  SequenceLayer& sl = sequence_at(staged.seq, "PagedKVCache::compact").layers[static_cast<size_t>(staged.layer)];
  if (quantized()) staged.rewritten.apply(pool.quantized, options_.head_dim);
  if (staged.destinations.defined()) {  // in-place copies, no allocation: applying must not fail
    pool.key_pool.view({-1, options_.head_dim}).index_copy_(0, staged.destinations, staged.moved_keys);
    pool.value_pool.view({-1, options_.head_dim}).index_copy_(0, staged.destinations, staged.moved_values);
  }
  for (int64_t h = 0; h < options_.kv_heads; ++h) {
    Head& head = sl.heads[static_cast<size_t>(h)];
    const std::vector<int64_t>& k = staged.kept[static_cast<size_t>(h)];
    // In place (k[j] >= j): applying allocates nothing.
    for (size_t j = 0; j < k.size(); ++j) head.positions[j] = head.positions[static_cast<size_t>(k[j])];
    head.positions.resize(k.size());
    const auto keep_pages = static_cast<size_t>(table_pages(static_cast<int64_t>(k.size())));
    pool.free_pages.insert(pool.free_pages.end(), head.pages.rbegin(),
                           head.pages.rbegin() + static_cast<std::ptrdiff_t>(head.pages.size() - keep_pages));
    head.pages.resize(keep_pages);
  }
  apply_tables(staged.layer, {staged.seq}, staged.upload);
}

void PagedKVCache::compact(int64_t layer, SequenceId seq, const at::Tensor& keep_mask) {
  apply_compaction(stage_compaction(layer, seq, keep_mask));
}

void PagedKVCache::compact(const std::vector<Compaction>& compactions) {
  std::set<std::pair<int64_t, SequenceId>> seen;
  for (const Compaction& c : compactions)
    TORCH_CHECK(seen.insert({c.layer, c.seq}).second, "PagedKVCache::compact: layer ", c.layer, " of sequence ", c.seq,
                " is compacted twice in one call");
  std::vector<StagedCompaction> staged;
  staged.reserve(compactions.size());
  for (const Compaction& c : compactions) staged.push_back(stage_compaction(c.layer, c.seq, c.keep_mask));
  for (const StagedCompaction& s : staged) apply_compaction(s);
}

// ---- memory --------------------------------------------------------------------------------------

int64_t PagedKVCache::pages_used_now() const {
  int64_t free = 0;
  for (const Layer& l : layers_) free += static_cast<int64_t>(l.free_pages.size());
  return options_.num_layers * options_.pages_per_layer - free;
}

PagedCacheStats PagedKVCache::stats() const {
  PagedCacheStats s;
  s.num_layers = options_.num_layers;
  s.pages_per_layer = options_.pages_per_layer;
  s.page_size = options_.page_size;
  for (const auto role : {KVRole::kKeys, KVRole::kValues})
    s.bytes_per_page += kv_page_layout(options_.kv_format, role, options_.page_size, options_.head_dim, options_.dtype)
                            .bytes_per_page(options_.page_size);
  if (quantized())
    s.residual_bytes = 2 * options_.num_layers * static_cast<int64_t>(layers_.front().quantized.residual_keys.nbytes());
  s.pages_used = pages_used_now();
  s.pages_free = options_.num_layers * options_.pages_per_layer - s.pages_used;
  s.peak_pages_used = std::max(peak_pages_used_, s.pages_used);
  s.sequences = static_cast<int64_t>(sequences_.size());
  // Per layer a [slots, Hkv, page_capacity] page table and a [slots, Hkv] length table, int64.
  s.table_bytes = static_cast<int64_t>(sizeof(int64_t)) * options_.num_layers * slot_capacity_ * options_.kv_heads *
                  (page_capacity_ + 1);
  for (const auto& entry : sequences_)
    for (const SequenceLayer& l : entry.second.layers)
      for (const Head& h : l.heads) s.tokens += static_cast<int64_t>(h.positions.size());
  return s;
}

void PagedKVCache::reset_peak() { peak_pages_used_ = pages_used_now(); }

int64_t PagedKVCache::free_pages(int64_t layer) const {
  check_layer(layer, "PagedKVCache::free_pages");
  return static_cast<int64_t>(layers_[static_cast<size_t>(layer)].free_pages.size());
}

const at::Tensor& PagedKVCache::key_pool(int64_t layer) const {
  check_layer(layer, "PagedKVCache::key_pool");
  TORCH_CHECK(!quantized(), "PagedKVCache::key_pool: the cache stores ", kv_format_name(options_.kv_format),
              " pages; quantized_pool() gives their codes, scales and residual rows");
  return layers_[static_cast<size_t>(layer)].key_pool;
}

const at::Tensor& PagedKVCache::value_pool(int64_t layer) const {
  check_layer(layer, "PagedKVCache::value_pool");
  TORCH_CHECK(!quantized(), "PagedKVCache::value_pool: the cache stores ", kv_format_name(options_.kv_format),
              " pages; quantized_pool() gives their codes, scales and residual rows");
  return layers_[static_cast<size_t>(layer)].value_pool;
}

QuantizedPagePool PagedKVCache::quantized_pool(int64_t layer) const {
  check_layer(layer, "PagedKVCache::quantized_pool");
  TORCH_CHECK(quantized(),
              "PagedKVCache::quantized_pool: the cache stores full pages (KVFormat::kFull); key_pool() "
              "and value_pool() give them");
  return layers_[static_cast<size_t>(layer)].quantized;
}

}  // namespace kvpress
