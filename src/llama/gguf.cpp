// GGUF file -> config.json, tokenizer.json and Hugging Face-named weights (kvpress/llama/gguf.h).
//
// The config and tokenizer are written as JSON and parsed by LlamaConfig::from_json and
// Tokenizer::from_json, so a GGUF checkpoint gets exactly the checks, defaults and semantics of
// a Hugging Face folder: this file only maps names.
#include "kvpress/llama/gguf.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

#include "kvpress/io/gguf.h"

namespace kvpress::llama {
namespace {

using json = nlohmann::json;

// Split regexes of the byte-level families' tokenizer.json files, for the GGUF pre-tokenizer names
// that stand for them (llama.cpp's llama-vocab.cpp runs the same expressions for these names).
constexpr const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// llama_token_type: 3 control (special: <|im_start|>), 4 user-defined (added, not special).
constexpr int64_t kTokenControl = 3;
constexpr int64_t kTokenUserDefined = 4;

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}
json split(const char* pattern) {
  return {{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}};
}

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path), file_(io::load_gguf(path)) {}

  GgufCheckpoint read() {
    arch_ = file_.get_string("general.architecture");
    check(arch_ == "llama" || arch_ == "qwen2" || arch_ == "qwen3", "general.architecture '", arch_,
          "' is not supported (llama, qwen2, qwen3)");
    GgufCheckpoint out;
    out.config_json = config().dump();
    out.tokenizer_json = tokenizer().dump();
    if (const io::GgufValue* t = file_.find("tokenizer.chat_template"); t && t->kind == io::GgufValue::Kind::kString)
      out.chat_template = t->string_value;
    out.weights = weights();
    return out;
  }

 private:
  template <typename... Args>
  void check(bool cond, const Args&... args) const {
    TORCH_CHECK(cond, "read_gguf_checkpoint: ", path_, ": ", args...);
  }
  std::string key(const std::string& name) const { return arch_ + "." + name; }
  bool has(const std::string& k) const { return file_.find(k) != nullptr; }

  json config() const {
    check(!file_.find_tensor("rope_freqs.weight"),
          "Llama 3.1-style RoPE frequency factors (rope_freqs.weight) are not supported; load the model's Hugging "
          "Face folder instead");
    json c;
    c["model_type"] = arch_;
    c["hidden_size"] = file_.get_int(key("embedding_length"));
    c["intermediate_size"] = file_.get_int(key("feed_forward_length"));
    c["num_hidden_layers"] = file_.get_int(key("block_count"));
    const int64_t heads = file_.get_int(key("attention.head_count"));
    c["num_attention_heads"] = heads;
    c["num_key_value_heads"] =
        has(key("attention.head_count_kv")) ? file_.get_int(key("attention.head_count_kv")) : heads;
    const int64_t head_dim = has(key("attention.key_length")) ? file_.get_int(key("attention.key_length"))
                                                              : c["hidden_size"].get<int64_t>() / heads;
    c["head_dim"] = head_dim;
    if (has(key("rope.dimension_count")))
      check(file_.get_int(key("rope.dimension_count")) == head_dim, key("rope.dimension_count"), " is ",
            file_.get_int(key("rope.dimension_count")), ": partial rotary embeddings are not supported (head_dim ",
            head_dim, ")");
    c["vocab_size"] = has(key("vocab_size")) ? file_.get_int(key("vocab_size"))
                                             : static_cast<int64_t>(file_.get_strings("tokenizer.ggml.tokens").size());
    if (has(key("rope.freq_base"))) c["rope_theta"] = file_.get_float(key("rope.freq_base"));
    c["rms_norm_eps"] = file_.get_float(key("attention.layer_norm_rms_epsilon"));
    if (has(key("context_length"))) c["max_position_embeddings"] = file_.get_int(key("context_length"));
    if (has(key("rope.scaling.type"))) {
      const std::string type = file_.get_string(key("rope.scaling.type"));
      if (type != "none") {
        json scaling{{"rope_type", type}};
        if (has(key("rope.scaling.factor"))) scaling["factor"] = file_.get_float(key("rope.scaling.factor"));
        c["rope_scaling"] = scaling;  // LlamaConfig refuses a type it does not support
      }
    }
    c["tie_word_embeddings"] = file_.find_tensor("output.weight") == nullptr;
    // Biases on the attention projections: Qwen2 always has q/k/v ones; Llama and Qwen3 say so with
    // attention_bias (then o_proj has one too).
    if (arch_ != "qwen2") c["attention_bias"] = file_.find_tensor("blk.0.attn_q.bias") != nullptr;
    if (has("tokenizer.ggml.bos_token_id")) c["bos_token_id"] = file_.get_int("tokenizer.ggml.bos_token_id");
    if (has("tokenizer.ggml.eos_token_id")) c["eos_token_id"] = file_.get_int("tokenizer.ggml.eos_token_id");
    return c;
  }

  json tokenizer() const {
    const std::string model = file_.get_string("tokenizer.ggml.model");
    check(
        model == "gpt2", "tokenizer.ggml.model '", model,
        "' is not supported (only gpt2, byte-level BPE); load the model's Hugging Face folder for its tokenizer.json");
    const std::string pre = has("tokenizer.ggml.pre") ? file_.get_string("tokenizer.ggml.pre") : "default";
    json t{{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}, {"normalizer", nullptr}};
    bool ignore_merges = false;
    if (pre == "smollm") {  // SmolLM2: digits one by one, then GPT-2's regex
      t["pre_tokenizer"] = {{"type", "Sequence"},
                            {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)}}};
    } else if (pre == "gpt-2") {
      t["pre_tokenizer"] = byte_level(true);
    } else if (pre == "llama-bpe") {  // Llama 3
      t["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {split(kLlama3Pattern), byte_level(false)}}};
      ignore_merges = true;
    } else if (pre == "qwen2") {
      t["normalizer"] = {{"type", "NFC"}};
      t["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {split(kQwen2Pattern), byte_level(false)}}};
    } else {
      check(false, "tokenizer.ggml.pre '", pre, "' is not supported (smollm, gpt-2, llama-bpe, qwen2)");
    }

    const std::vector<std::string> tokens = file_.get_strings("tokenizer.ggml.tokens");
    const std::vector<int64_t> types =
        has("tokenizer.ggml.token_type") ? file_.get_ints("tokenizer.ggml.token_type") : std::vector<int64_t>();
    check(types.empty() || types.size() == tokens.size(), "tokenizer.ggml.token_type has ", types.size(),
          " entries for ", tokens.size(), " tokens");
    json vocab = json::object(), added = json::array();
    for (size_t id = 0; id < tokens.size(); ++id) {
      check(!vocab.contains(tokens[id]), "tokenizer.ggml.tokens holds '", tokens[id], "' twice");
      vocab[tokens[id]] = id;
      const int64_t type = types.empty() ? 1 : types[id];
      if (type == kTokenControl || type == kTokenUserDefined)
        added.push_back({{"id", id},
                         {"content", tokens[id]},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", type == kTokenControl}});
    }
    t["added_tokens"] = added;
    const std::vector<std::string> merges =
        has("tokenizer.ggml.merges") ? file_.get_strings("tokenizer.ggml.merges") : std::vector<std::string>();
    t["model"] = {{"type", "BPE"},     {"dropout", nullptr},     {"unk_token", nullptr},
                  {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", ignore_merges},
                  {"vocab", vocab},    {"merges", json(merges)}};
    const bool add_bos = has("tokenizer.ggml.add_bos_token") && file_.get_bool("tokenizer.ggml.add_bos_token");
    if (add_bos) {
      const int64_t bos = file_.get_int("tokenizer.ggml.bos_token_id");
      check(bos >= 0 && bos < static_cast<int64_t>(tokens.size()), "tokenizer.ggml.bos_token_id ", bos,
            " is not a token id");
      const std::string& name = tokens[static_cast<size_t>(bos)];
      t["post_processor"] = {
          {"type", "TemplateProcessing"},
          {"single",
           {{{"SpecialToken", {{"id", name}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
          {"pair", json::array()},
          {"special_tokens", {{name, {{"id", name}, {"ids", {bos}}, {"tokens", {name}}}}}}};
    } else {
      t["post_processor"] = {
          {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
    }
    t["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
    return t;
  }

  // llama.cpp's converter stores a llama model's q/k rows with each head's two RoPE halves
  // interleaved; rows [n_head, 2, D/2] -> [n_head, D/2, 2] undoes it (transformers'
  // reverse_permute_weights). Biases are rows too.
  static at::Tensor unpermute(const at::Tensor& w, int64_t heads) {
    const int64_t rows = w.size(0);
    std::vector<int64_t> grouped{heads, rows / heads / 2, 2};
    for (int64_t d = 1; d < w.dim(); ++d) grouped.push_back(w.size(d));
    return w.reshape(grouped).transpose(1, 2).reshape(w.sizes()).contiguous();
  }

  std::map<std::string, at::Tensor> weights() const {
    const int64_t layers = file_.get_int(key("block_count"));
    const int64_t heads = file_.get_int(key("attention.head_count"));
    const int64_t kv_heads =
        has(key("attention.head_count_kv")) ? file_.get_int(key("attention.head_count_kv")) : heads;
    std::map<std::string, at::Tensor> out;
    std::set<std::string> used;
    const auto take = [&](const std::string& gguf_name, const std::string& hf_name, int64_t permute_heads = 0) {
      if (!file_.find_tensor(gguf_name)) return;
      at::Tensor t = file_.dequantize(gguf_name);
      if (permute_heads > 0) {
        check(t.size(0) % (2 * permute_heads) == 0, gguf_name, " has ", t.size(0), " rows, not a multiple of 2 x ",
              permute_heads, " heads");
        t = unpermute(t, permute_heads);
      }
      out[hf_name] = t;
      used.insert(gguf_name);
    };
    take("token_embd.weight", "model.embed_tokens.weight");
    take("output_norm.weight", "model.norm.weight");
    take("output.weight", "lm_head.weight");
    const bool permuted = arch_ == "llama";
    for (int64_t i = 0; i < layers; ++i) {
      const std::string g = "blk." + std::to_string(i) + ".", h = "model.layers." + std::to_string(i) + ".";
      take(g + "attn_norm.weight", h + "input_layernorm.weight");
      take(g + "ffn_norm.weight", h + "post_attention_layernorm.weight");
      for (const char* suffix : {"weight", "bias"}) {
        const std::string s = suffix;
        take(g + "attn_q." + s, h + "self_attn.q_proj." + s, permuted ? heads : 0);
        take(g + "attn_k." + s, h + "self_attn.k_proj." + s, permuted ? kv_heads : 0);
        take(g + "attn_v." + s, h + "self_attn.v_proj." + s);
        take(g + "attn_output." + s, h + "self_attn.o_proj." + s);
      }
      take(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight");
      take(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight");
      take(g + "ffn_gate.weight", h + "mlp.gate_proj.weight");
      take(g + "ffn_up.weight", h + "mlp.up_proj.weight");
      take(g + "ffn_down.weight", h + "mlp.down_proj.weight");
    }
    // A tensor the architecture does not use means a variant this reader does not know (MoE
    // experts, a vision tower, ...): refuse rather than run without it.
    for (const io::GgufTensorInfo& t : file_.tensors())
      check(used.count(t.name), "tensor '", t.name, "' is not part of the ", arch_, " architecture this reader knows");
    return out;
  }

  std::string path_;
  io::GgufFile file_;
  std::string arch_;
};

}  // namespace

GgufCheckpoint read_gguf_checkpoint(const std::string& path) { return Reader(path).read(); }

}  // namespace kvpress::llama
