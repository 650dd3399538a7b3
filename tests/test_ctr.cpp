// QSMPress / CTRPress (CTR-Press, github.com/xiyuanyang-code/CTRPress).
//
// Two kinds of checks:
//  * against the reference code: tests/data/ctr/ holds what the reference presses computed
//    (tests/reference/make_ctr_fixtures.py, run on a CTRPress checkout; committed because CI has no
//    GitHub access). Compared: semantic weights of every TinyStories-656K token, stage-I scores and
//    kept positions on both TinyStories layers (4 KV heads), CTRPress's kept positions there with
//    entropy=reference, and on a one-KV-head layer also the merged and rescued values.
//  * against the formulas, written out here independently (loops in double), where the reference
//    cannot serve: the per-head merge and rescue with several KV heads (the reference's helpers
//    assume head-shared kept positions), the default entropy over the non-forced tokens, and the
//    semantic heuristic's rules one by one.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kvpress/io/safetensors.h"
#include "kvpress/llama/llama.h"
#include "kvpress/ops.h"
#include "kvpress/presses/ctr_press.h"
#include "kvpress/presses/qsm_press.h"
#include "kvpress/registry.h"
#include "test_util.h"

namespace {

using kvpress::CTREntropy;
using kvpress::CTROptions;
using kvpress::CTRPress;
using kvpress::LayerInputs;
using kvpress::QSMOptions;
using kvpress::QSMPress;
using kvpress::QSMScores;
using kvpress::testing::expect_error;

constexpr float kFloatMax = std::numeric_limits<float>::max();

at::Tensor mask(std::initializer_list<int64_t> bits) { return at::tensor(at::ArrayRef<int64_t>(bits)).to(at::kBool); }

const std::string& model_dir() {
  static const std::string dir = kvpress::llama::resolve_model_dir("tinystories-656k");
  return dir;
}
const kvpress::llama::Tokenizer& tokenizer() {
  static const auto tok = kvpress::llama::Tokenizer::load(model_dir() + "/tokenizer.json");
  return tok;
}
kvpress::TokenTextFn token_text() {
  return [](int64_t id) { return tokenizer().decode({id}, /*skip_special_tokens=*/false); };
}

// ---- semantic weights ---------------------------------------------------------------------------

TEST(CTRSemantic, RulesOneByOne) {
  using kvpress::semantic_weight;
  EXPECT_DOUBLE_EQ(semantic_weight("2024", 5), 1.0);             // digit
  EXPECT_DOUBLE_EQ(semantic_weight(" Tom", 5), 0.5);             // capital
  EXPECT_DOUBLE_EQ(semantic_weight(" the", 5), -0.3);            // stopword (stripped, lowercased)
  EXPECT_DOUBLE_EQ(semantic_weight("The", 5), 0.5 - 0.3);        // capital and stopword
  EXPECT_DOUBLE_EQ(semantic_weight("   ", 5), -0.3);             // blank
  EXPECT_DOUBLE_EQ(semantic_weight("\n", 5), 0.2 - 0.3);         // punctuation and blank
  EXPECT_DOUBLE_EQ(semantic_weight("wonderful", 5), 0.3);        // 9 characters: rare
  EXPECT_DOUBLE_EQ(semantic_weight("foo_bar()", 5), 0.3 + 0.4);  // rare and code symbols
  EXPECT_DOUBLE_EQ(semantic_weight("a.b", 5), 0.2 + 0.4);        // '.' is punctuation and code
  EXPECT_DOUBLE_EQ(semantic_weight("!", 5), 0.2);
  EXPECT_DOUBLE_EQ(semantic_weight("", 5), -0.3);
  // Length in code points: 7 two-byte characters are not rare, 8 are.
  EXPECT_DOUBLE_EQ(semantic_weight("\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9", 5), 0.0);
  EXPECT_DOUBLE_EQ(semantic_weight("\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9\xC3\xA9", 5), 0.3);
  kvpress::SemanticWeightOptions o;
  o.rare_token_id_threshold = 100;
  EXPECT_DOUBLE_EQ(semantic_weight("x", 99, o), 0.0);
  EXPECT_DOUBLE_EQ(semantic_weight("x", 100, o), 0.3);
  o.digit_weight = 2.0;
  EXPECT_DOUBLE_EQ(semantic_weight("7", 1, o), 2.0);
}

// ---- reference data -----------------------------------------------------------------------------

struct Reference {
  nlohmann::json manifest;
  kvpress::io::SafetensorsFile file;
  const at::Tensor& get(const std::string& key) const {
    const auto it = file.tensors.find(key);
    if (it == file.tensors.end()) throw std::runtime_error("tests/data/ctr: no tensor " + key);
    return it->second;
  }
};

const Reference& reference() {
  static const Reference ref = [] {
    const std::string dir = std::string(KVPRESS_TEST_DATA_DIR) + "/ctr";
    std::ifstream in(dir + "/manifest.json");
    if (!in) throw std::runtime_error("missing " + dir + "/manifest.json (tests/reference/make_ctr_fixtures.py)");
    Reference r;
    in >> r.manifest;
    r.file = kvpress::io::load_safetensors(dir + "/" + r.manifest.at("file").get<std::string>());
    return r;
  }();
  return ref;
}

std::map<std::string, std::string> params_of(const nlohmann::json& run) {
  return run.at("params").get<std::map<std::string, std::string>>();
}

TEST(CTRReference, SemanticWeightsOfEveryToken) {
  const at::Tensor expected = reference().get("semantic_weights");
  const auto& tok = tokenizer();
  ASSERT_EQ(expected.numel(), tok.vocab_size());
  int64_t mismatches = 0;
  for (int64_t id = 0; id < expected.numel(); ++id) {
    const std::string text = tok.decode({id}, false);
    const float ours = static_cast<float>(kvpress::semantic_weight(text, id));
    if (ours != expected[id].item<float>() && ++mismatches <= 5)
      ADD_FAILURE() << "id " << id << " '" << text << "': " << ours << " vs reference " << expected[id].item<float>();
  }
  EXPECT_EQ(mismatches, 0);
}

// The one-KV-head layer: every head keeps the same positions, so the reference's merge and rescue
// (written for head-shared kept positions) are exactly what the per-head versions compute.
TEST(CTRReference, OneKvHeadScoresKeptAndMergedValues) {
  const Reference& ref = reference();
  LayerInputs in;
  in.keys = ref.get("mqa.keys");
  in.values = ref.get("mqa.values");
  in.hidden_states = ref.get("mqa.hidden_states");
  in.q_proj = ref.get("mqa.q_proj");
  in.cos = ref.get("mqa.cos");
  in.sin = ref.get("mqa.sin");
  in.input_ids = ref.get("mqa.input_ids");
  in.num_heads = 4;
  int runs = 0;
  for (const auto& run : ref.manifest.at("runs")) {
    if (run.at("case") != "mqa") continue;
    ++runs;
    const std::string name = run.at("name");
    SCOPED_TRACE(name);
    auto press = kvpress::make_press(run.at("press"), run.at("compression_ratio").get<double>(), params_of(run));
    auto* qsm = dynamic_cast<QSMPress*>(press.get());
    ASSERT_NE(qsm, nullptr);
    qsm->set_token_text(token_text());
    const QSMScores st = qsm->stage_one_scores(in);
    EXPECT_TRUE(at::allclose(st.base, ref.get("mqa." + name + ".base_scores"), 1e-5, 1e-6));
    EXPECT_TRUE(at::allclose(st.scores, ref.get("mqa." + name + ".scores"), 1e-5, 1e-6));
    const kvpress::KV kv = press->compress(in);
    const at::Tensor kept = ref.get("mqa." + name + ".kept_indices");
    ASSERT_EQ(kv.kept_indices.size(2), run.at("n_kept").get<int64_t>());
    EXPECT_TRUE(at::equal(kv.kept_indices, kept));
    EXPECT_TRUE(at::equal(kv.keys, kvpress::ops::gather_kv(in.keys, in.values, kept).keys));
    const at::Tensor values = ref.get("mqa." + name + ".values");
    EXPECT_TRUE(at::allclose(kv.values, values, 1e-5, 1e-6)) << (kv.values - values).abs().max().item<float>();
  }
  EXPECT_EQ(runs, 10);
}

// TinyStories-656K, both layers, inputs rebuilt by the C++ runner on the reference's ids.
struct CapturedLayers {
  std::vector<LayerInputs> inputs;
  std::vector<kvpress::KV> outputs;
};

CapturedLayers prefill_with(const kvpress::BasePress& press, const at::Tensor& ids, kvpress::llama::KVCache& cache,
                            at::Tensor* logits = nullptr) {
  static const auto model = kvpress::llama::LlamaModel::load(model_dir());
  CapturedLayers out;
  kvpress::llama::PrefillOptions opt;
  opt.press = &press;
  opt.on_compress = [&out](const LayerInputs& in, const kvpress::KV& kv) {
    out.inputs.push_back(in);
    out.outputs.push_back(kv);
  };
  const auto result = model.prefill(ids, cache, opt);
  if (logits) *logits = result.logits;
  return out;
}

// Kept sets equal, except for positions whose reference score is within `tol` of the threshold
// (the runner's inputs differ from transformers' by ~1e-6).
void expect_same_kept(const at::Tensor& ours, const at::Tensor& theirs, const at::Tensor& ref_scores, double tol) {
  ASSERT_EQ(ours.sizes(), theirs.sizes());
  for (int64_t h = 0; h < ours.size(1); ++h) {
    const at::Tensor s = ref_scores[0][h];
    const float threshold = std::get<0>(s.sort(-1, true))[theirs.size(2) - 1].item<float>();
    std::set<int64_t> a, b;
    for (int64_t i = 0; i < ours.size(2); ++i) {
      a.insert(ours[0][h][i].item<int64_t>());
      b.insert(theirs[0][h][i].item<int64_t>());
    }
    for (int64_t p : a)
      if (!b.count(p)) EXPECT_LE(std::abs(s[p].item<float>() - threshold), tol) << "head " << h << " position " << p;
    for (int64_t p : b)
      if (!a.count(p)) EXPECT_LE(std::abs(s[p].item<float>() - threshold), tol) << "head " << h << " position " << p;
  }
}

TEST(CTRReference, TinyStoriesStageOneScoresAndKept) {
  const Reference& ref = reference();
  const at::Tensor ids = ref.get("tiny.input_ids");
  for (double ratio : {0.5, 0.25}) {
    for (const char* press_name : {"QSMPress", "CTRPress"}) {
      if (std::string(press_name) == "QSMPress" && ratio != 0.5) continue;
      SCOPED_TRACE(std::string(press_name) + " ratio " + std::to_string(ratio));
      std::map<std::string, std::string> params;
      if (std::string(press_name) == "CTRPress") params["entropy"] = "reference";
      auto press = kvpress::make_press(press_name, ratio, params);
      dynamic_cast<QSMPress&>(*press).set_token_text(token_text());
      auto cache = kvpress::llama::LlamaModel::load(model_dir()).new_cache();
      const CapturedLayers layers = prefill_with(*press, ids, cache);
      ASSERT_EQ(layers.inputs.size(), 2u);
      for (int layer = 0; layer < 2; ++layer) {
        const std::string tag = "tiny_l" + std::to_string(layer) + ".";
        const std::string run =
            std::string(press_name) == "QSMPress" ? "qsm_r0.5" : "ctr_r" + std::string(ratio == 0.5 ? "0.5" : "0.25");
        const at::Tensor ref_scores = ref.get(tag + "qsm_r0.5.scores");
        const at::Tensor ours = dynamic_cast<QSMPress&>(*press).score(layers.inputs[layer]);
        EXPECT_TRUE(at::allclose(ours, ref_scores, 1e-4, 1e-5)) << (ours - ref_scores).abs().max().item<float>();
        const at::Tensor ref_kept = ref.get(tag + run + ".kept_indices");
        // With 4 KV heads the reference's head-mean entropy overflows: n' = round(0.8 n).
        if (std::string(press_name) == "CTRPress") {
          const int64_t n = static_cast<int64_t>(ids.size(1) * (1.0 - ratio));
          EXPECT_EQ(ref_kept.size(2), static_cast<int64_t>(std::nearbyint(0.8 * static_cast<double>(n))));
        }
        expect_same_kept(layers.outputs[layer].kept_indices, ref_kept, ref_scores, 1e-4);
        EXPECT_EQ(cache.length(layer), ref_kept.size(2));
      }
    }
  }
}

// ---- stage I against the formula --------------------------------------------------------------

// The stage-I scores by the formula, in double: per KV head the group-mean query of each span
// position, causal softmax over all keys, alpha * mean + (1 - alpha) * max, min-max, pseudo-query 0,
// forced float max, semantic factor.
std::vector<std::vector<double>> formula_scores(const at::Tensor& queries, const at::Tensor& keys, int64_t start,
                                                double alpha, bool pseudo, const std::vector<bool>& forced,
                                                const std::vector<double>& w, double lambda) {
  const int64_t hq = queries.size(1), hkv = keys.size(1), seq = keys.size(2), d = keys.size(3), g = hq / hkv;
  const auto q = queries.accessor<float, 4>();
  const auto k = keys.accessor<float, 4>();
  std::vector<std::vector<double>> out(static_cast<size_t>(hkv));
  for (int64_t h = 0; h < hkv; ++h) {
    std::vector<double> mean(static_cast<size_t>(seq), 0.0), mx(static_cast<size_t>(seq), 0.0);
    const int64_t span = seq - start;
    for (int64_t i = 0; i < span; ++i) {
      std::vector<double> qv(static_cast<size_t>(d), 0.0);
      for (int64_t j = 0; j < g; ++j)
        for (int64_t c = 0; c < d; ++c) qv[c] += q[0][h * g + j][start + i][c] / static_cast<double>(g);
      std::vector<double> logit(static_cast<size_t>(start + i + 1));
      double top = -1e300, z = 0.0;
      for (int64_t p = 0; p <= start + i; ++p) {
        double dot = 0.0;
        for (int64_t c = 0; c < d; ++c) dot += qv[c] * k[0][h][p][c];
        logit[p] = dot / std::sqrt(static_cast<double>(d));
        top = std::max(top, logit[p]);
      }
      for (double l : logit) z += std::exp(l - top);
      for (int64_t p = 0; p <= start + i; ++p) {
        const double a = std::exp(logit[p] - top) / z;
        mean[p] += a / static_cast<double>(span);
        mx[p] = std::max(mx[p], a);
      }
    }
    std::vector<double> s(static_cast<size_t>(seq));
    double lo = 1e300, hi = -1e300;
    for (int64_t p = 0; p < seq; ++p) {
      s[p] = alpha * mean[p] + (1 - alpha) * mx[p];
      lo = std::min(lo, s[p]);
      hi = std::max(hi, s[p]);
    }
    for (int64_t p = 0; p < seq; ++p) {
      s[p] = (s[p] - lo) / std::max(hi - lo, 1e-6);
      if (pseudo && p >= start) s[p] = 0.0;
      s[p] = forced[p] ? kFloatMax : s[p] * (w.empty() ? 1.0 : 1.0 + lambda * std::tanh(w[p]));
    }
    out[h] = s;
  }
  return out;
}

LayerInputs small_layer(int64_t hq, int64_t hkv, int64_t seq, int64_t d, uint64_t seed) {
  LayerInputs in;
  in.keys = kvpress::testing::randn({1, hkv, seq, d}, seed);
  in.values = kvpress::testing::randn({1, hkv, seq, d}, seed + 1);
  in.queries = kvpress::testing::randn({1, hq, seq, d}, seed + 2) * 2.0;
  return in;
}

TEST(QSMPress, QuerySpanForcedKeepsAndBudget) {
  QSMPress pseudo(0.5);
  EXPECT_EQ(pseudo.query_span(80), (std::pair<int64_t, int64_t>{70, 80}));  // min(128, int(80 * 0.125))
  at::Tensor forced = pseudo.forced_keep_mask(80);
  EXPECT_EQ(forced.sum().item<int64_t>(), 4 + 32);  // sinks + the last 32 (covering the pseudo-query)
  EXPECT_TRUE(forced.narrow(0, 0, 4).all().item<bool>());
  EXPECT_TRUE(forced.narrow(0, 48, 32).all().item<bool>());
  EXPECT_EQ(pseudo.kept_count(80), 40);
  EXPECT_EQ(QSMPress(0.75).kept_count(80), 36);  // never fewer than the forced keeps
  QSMOptions o;
  o.query_length = 12;
  o.sink_tokens = 2;
  o.recent_tokens = 8;
  QSMPress query(0.5, o);
  EXPECT_EQ(query.query_span(80), (std::pair<int64_t, int64_t>{68, 80}));
  forced = query.forced_keep_mask(80);
  // Sinks, the 8 context tokens before the question, the question.
  EXPECT_EQ(forced.sum().item<int64_t>(), 2 + 8 + 12);
  EXPECT_TRUE(forced.narrow(0, 60, 20).all().item<bool>());
  EXPECT_FALSE(forced[59].item<bool>());
  EXPECT_EQ(QSMPress(0.0, o).query_span(5), (std::pair<int64_t, int64_t>{0, 5}));
}

TEST(QSMPress, StageOneScoresMatchTheFormula) {
  for (const auto& [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {4, 2}, {3, 1}}) {
    SCOPED_TRACE(std::to_string(hq) + "/" + std::to_string(hkv));
    const int64_t seq = 24;
    LayerInputs in = small_layer(hq, hkv, seq, 8, 7 + hq);
    in.input_ids = at::arange(seq, at::kLong).unsqueeze(0);
    QSMOptions o;
    o.sink_tokens = 2;
    o.recent_tokens = 3;
    o.pseudo_query_len = 5;
    o.pseudo_query_max_fraction = 1.0;
    o.qa_alpha = 0.3;
    // Token text: ids divisible by 3 are digits (+1), by 4 stopwords (-0.3).
    auto text = [](int64_t id) {
      return id % 3 == 0 ? std::string("7") : id % 4 == 0 ? std::string(" the") : std::string("x");
    };
    QSMPress press(0.5, o, text);
    const QSMScores st = press.stage_one_scores(in);
    std::vector<bool> forced(seq);
    std::vector<double> w(seq);
    for (int64_t p = 0; p < seq; ++p) {
      forced[p] = p < 2 || p >= seq - 5;
      w[p] = kvpress::semantic_weight(text(p), p);
    }
    const auto expected = formula_scores(in.queries, in.keys, seq - 5, 0.3, true, forced, w, 0.3);
    const auto no_sem = formula_scores(in.queries, in.keys, seq - 5, 0.3, true, forced, {}, 0.3);
    for (int64_t h = 0; h < hkv; ++h)
      for (int64_t p = 0; p < seq; ++p) {
        EXPECT_NEAR(st.scores[0][h][p].item<double>(), expected[h][p], 1e-5 * std::max(1.0, expected[h][p]));
        EXPECT_NEAR(st.base[0][h][p].item<double>(), no_sem[h][p], 1e-5 * std::max(1.0, no_sem[h][p]));
      }
    // Selection: the forced keeps plus the best of the rest; without the callback w = 0.
    const kvpress::KV kv = press.compress(in);
    EXPECT_EQ(kv.kept_indices.size(2), 12);
    EXPECT_TRUE(at::equal(kv.kept_indices, kvpress::ops::topk_indices(st.scores, 12)));
    EXPECT_TRUE(at::equal(kv.values, kvpress::ops::gather_kv(in.keys, in.values, kv.kept_indices).values));  // no merge
    EXPECT_TRUE(at::equal(QSMPress(0.5, o).score(in), st.base));
  }
}

// Long contexts: the query rows are processed in chunks of at most 4M logits, and the mean/max
// over the query span are accumulated across chunks (here 2 chunks: 174 + 26 rows).
TEST(QSMPress, ChunkedQueryRowsMatchTheFormula) {
  const int64_t seq = 12000, q_len = 200;
  LayerInputs in = small_layer(4, 2, seq, 8, 21);
  QSMOptions o;
  o.pseudo_query_len = q_len;
  o.pseudo_query_max_fraction = 1.0;
  o.qa_alpha = 0.3;
  const QSMScores st = QSMPress(0.5, o).stage_one_scores(in);
  std::vector<bool> forced(seq);
  for (int64_t p = 0; p < seq; ++p) forced[p] = p < o.sink_tokens || p >= seq - std::max(q_len, o.recent_tokens);
  const auto expected = formula_scores(in.queries, in.keys, seq - q_len, 0.3, true, forced, {}, 0.3);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t p = 0; p < seq; p += 7)
      ASSERT_NEAR(st.base[0][h][p].item<double>(), expected[h][p], 1e-5 * std::max(1.0, expected[h][p]))
          << "head " << h << " position " << p;
}

// ---- merge against the formula ----------------------------------------------------------------

TEST(QSMPress, MergeIntoNearestKeptPerHead) {
  // Head 0 keeps {1, 4}; head 1 keeps {0, 3}: position 2 is equidistant from 1 and 3... for head 1
  // it sits between 0 and 3 (nearer 3); position 5 of head 1 goes to 3.
  const at::Tensor values =
      at::tensor({1.f, 2.f, 7.f, 4.f, 5.f, 9.f, 3.f, 8.f, 6.f, 2.f, 4.f, 10.f}).view({1, 2, 6, 1});
  const at::Tensor kept = at::tensor({1L, 4L, 0L, 3L}).view({1, 2, 2});
  at::Tensor w = at::ones({1, 2, 6});
  w[0][1][1] = 0.5;
  w[0][1][2] = 0.0;  // weight 0: not merged
  const double alpha = 0.2, p = 0.75;
  const at::Tensor kept_values = kvpress::ops::gather_kv(values, values, kept).values;
  const at::Tensor out = kvpress::merge_into_nearest_kept(kept_values, values, kept, w, alpha, p);
  auto blend = [&](double v, double mass, double weighted_sum) {
    const double e = alpha * std::pow(mass, 1 - p);
    return (v + e * weighted_sum / mass) / (1 + e);
  };
  // Head 0: slot 1 <- {0, 2} (2 is 1 from 1 and 2 from 4), slot 4 <- {3, 5}.
  EXPECT_NEAR(out[0][0][0][0].item<double>(), blend(2, 2, 1 + 7), 1e-6);
  EXPECT_NEAR(out[0][0][1][0].item<double>(), blend(5, 2, 4 + 9), 1e-6);
  // Head 1 (values 3 8 6 2 4 10): slot 0 <- {1 (w 0.5)}, slot 3 <- {4, 5}; 2 has weight 0.
  EXPECT_NEAR(out[0][1][0][0].item<double>(), blend(3, 0.5, 0.5 * 8), 1e-6);
  EXPECT_NEAR(out[0][1][1][0].item<double>(), blend(2, 2, 4 + 10), 1e-6);
  // A tie goes to the lower kept position: kept {1, 3}, position 2.
  const at::Tensor v1 = values.narrow(1, 0, 1);
  const at::Tensor k1 = at::tensor({1L, 3L}).view({1, 1, 2});
  at::Tensor w1 = at::zeros({1, 1, 6});
  w1[0][0][2] = 1.0;
  const at::Tensor tie =
      kvpress::merge_into_nearest_kept(kvpress::ops::gather_kv(v1, v1, k1).values, v1, k1, w1, alpha, p);
  EXPECT_NEAR(tie[0][0][0][0].item<double>(), blend(2, 1, 7), 1e-6);
  EXPECT_NEAR(tie[0][0][1][0].item<double>(), 4.0, 1e-6);
}

TEST(QSMPress, ScoreMergeWeights) {
  QSMScores st;
  st.base = at::tensor({0.9f, 0.2f, 0.6f, 0.1f, 0.5f, kFloatMax}).view({1, 1, 6});
  st.scores = st.base;
  st.forced = mask({0, 0, 0, 0, 0, 1});
  const at::Tensor kept = at::tensor({0L, 4L, 5L}).view({1, 1, 3});
  // tau = lowest non-forced kept base score = 0.5.
  const at::Tensor w = QSMPress(0.5).merge_weights(st, kept);
  const std::vector<double> expected{0, 0 /* 0.4 < 0.5 */, 1 /* clipped */, 0 /* 0.2 */, 0, 0};
  for (int64_t p = 0; p < 6; ++p) EXPECT_NEAR(w[0][0][p].item<double>(), expected[p], 1e-7) << p;
  QSMOptions o;
  o.merge_min_score_ratio = 0.1;
  o.merge_score_power = 2.0;
  const at::Tensor w2 = QSMPress(0.5, o).merge_weights(st, kept);
  EXPECT_NEAR(w2[0][0][1].item<double>(), 0.4 * 0.4, 1e-6);
  EXPECT_NEAR(w2[0][0][3].item<double>(), 0.2 * 0.2, 1e-6);
  o.merge_weighting = kvpress::MergeWeighting::kUniform;
  EXPECT_TRUE(
      at::equal(QSMPress(0.5, o).merge_weights(st, kept), at::tensor({0.f, 1.f, 1.f, 1.f, 0.f, 0.f}).view({1, 1, 6})));
}

TEST(QSMPress, CompressMergesValuesWithAnExplicitQuery) {
  LayerInputs in = small_layer(4, 2, 30, 8, 21);
  QSMOptions o;
  o.query_length = 6;
  o.sink_tokens = 1;
  o.recent_tokens = 2;
  o.merge_weighting = kvpress::MergeWeighting::kUniform;
  QSMPress press(0.6, o);
  const kvpress::KV kv = press.compress(in);
  const QSMScores st = press.stage_one_scores(in);
  const kvpress::KV plain = kvpress::ops::gather_kv(in.keys, in.values, kv.kept_indices);
  EXPECT_TRUE(at::equal(kv.keys, plain.keys));  // keys untouched
  const at::Tensor expected = kvpress::merge_into_nearest_kept(plain.values, in.values, kv.kept_indices,
                                                               press.merge_weights(st, kv.kept_indices), 0.2, 0.75);
  EXPECT_TRUE(at::allclose(kv.values, expected));
  EXPECT_FALSE(at::allclose(kv.values, plain.values));
  o.use_merge = false;
  EXPECT_TRUE(at::equal(QSMPress(0.6, o).compress(in).values, plain.values));
}

// ---- stage II against the formula --------------------------------------------------------------

double entropy_of(const std::vector<double>& x) {
  double top = -1e300, z = 0, e = 0;
  for (double v : x) top = std::max(top, v);
  for (double v : x) z += std::exp(v - top);
  for (double v : x) {
    const double p = std::exp(v - top) / z;
    e -= p * std::log(p);
  }
  return e;
}

TEST(CTRPress, EntropyBothModes) {
  const at::Tensor scores = at::tensor({kFloatMax, 0.2f, 0.5f, 0.9f, kFloatMax, 0.4f, 0.1f, 0.3f}).view({1, 2, 4});
  const at::Tensor forced = mask({1, 0, 0, 0});
  const double e = entropy_of({0.3, 0.3, 0.6}) / std::log(3.0);
  EXPECT_NEAR(kvpress::ctr_normalized_entropy(scores, forced, CTREntropy::kNonForced), e, 1e-6);
  // Reference: two KV heads overflow the head mean of float max -> NaN -> 1.
  EXPECT_EQ(kvpress::ctr_normalized_entropy(scores, forced, CTREntropy::kReference), 1.0);
  // One KV head: the forced tokens take all the mass, E = ln(#forced).
  const at::Tensor one = at::tensor({kFloatMax, 0.2f, kFloatMax, 0.9f}).view({1, 1, 4});
  const at::Tensor forced2 = mask({1, 0, 1, 0});
  EXPECT_NEAR(kvpress::ctr_normalized_entropy(one, forced2, CTREntropy::kReference), std::log(2.0) / std::log(4.0),
              1e-6);
  // Nothing to spread.
  EXPECT_LT(kvpress::ctr_normalized_entropy(one, mask({1, 1, 1, 0}), CTREntropy::kNonForced), 0.0);
}

TEST(CTRPress, AdaptiveBudget) {
  // S = 12, ratio 0.5, one forced token (the pseudo-query of length 1): n = 6.
  QSMOptions q;
  q.sink_tokens = 0;
  q.recent_tokens = 0;
  q.pseudo_query_len = 1;
  CTROptions c;
  c.entropy = CTREntropy::kReference;
  c.entropy_beta = 0.25;
  LayerInputs in = small_layer(2, 2, 12, 4, 3);
  const CTRPress reference(0.5, q, c);
  const QSMScores st = reference.stage_one_scores(in);
  // Two KV heads: e = 1, n' = round(6 * 0.75) = round(4.5) = 4 (half to even, as Python).
  EXPECT_EQ(reference.adaptive_kept_count(st), 4);
  EXPECT_EQ(reference.compress(in).kept_indices.size(2), 4);
  c.entropy = CTREntropy::kNonForced;
  const CTRPress fixed(0.5, q, c);
  const double e = kvpress::ctr_normalized_entropy(st.scores, st.forced, CTREntropy::kNonForced);
  EXPECT_EQ(fixed.adaptive_kept_count(st), static_cast<int64_t>(std::nearbyint(6 * (1 + 0.25 * (1 - 2 * e)))));
  c.use_layer_adaptive = false;
  EXPECT_EQ(CTRPress(0.5, q, c).adaptive_kept_count(st), 6);
  // The default mode never keeps fewer than the forced tokens: beta 1 and a flat distribution.
  QSMOptions flat = q;
  flat.use_query_aware = false;
  flat.recent_tokens = 5;
  CTROptions strong;
  strong.entropy_beta = 1.0;
  const CTRPress press(0.7, flat, strong);
  EXPECT_EQ(press.adaptive_kept_count(press.stage_one_scores(in)), 5);
}

TEST(CTRPress, RescueScoresMatchTheFormula) {
  const at::Tensor keys = at::tensor({0.f, 1.f, 2.f, 3.f, 0.5f, -1.f, 1.5f, 0.f}).view({1, 2, 4, 1});
  const at::Tensor queries = at::tensor({1.f, -1.f, 2.f, 0.f, 0.5f, 1.f, -2.f, 1.f}).view({1, 2, 4, 1});
  const at::Tensor kept = at::tensor({0L, 2L}).view({1, 2, 1});
  const at::Tensor rho = kvpress::ctr_rescue_scores(queries, keys, kept);
  const auto k = keys.accessor<float, 4>();
  const auto q = queries.accessor<float, 4>();
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t kept_pos = h == 0 ? 0 : 2;
    for (int64_t r = 0; r < 4; ++r) {
      if (r == kept_pos) {
        EXPECT_EQ(rho[0][h][r].item<float>(), -1.f);
        continue;
      }
      double best = 0;
      for (int64_t i = 0; i < 4; ++i) {
        double z = 0;
        for (int64_t j = 0; j < 4; ++j)
          if (j != kept_pos) z += std::exp(q[0][h][i][0] * k[0][h][j][0]);
        best = std::max(best, std::exp(q[0][h][i][0] * k[0][h][r][0]) / z);
      }
      EXPECT_NEAR(rho[0][h][r].item<double>(), best, 1e-6) << h << " " << r;
    }
  }
}

TEST(CTRPress, RescueMergesTheTopEvictedPerHead) {
  LayerInputs in = small_layer(4, 2, 40, 8, 31);
  QSMOptions q;
  q.sink_tokens = 2;
  q.recent_tokens = 4;
  CTROptions c;
  c.rescue_ratio = 0.25;
  c.use_layer_adaptive = false;
  const CTRPress press(0.5, q, c);
  const kvpress::KV kv = press.compress(in);
  ASSERT_EQ(kv.kept_indices.size(2), 20);
  const kvpress::KV plain = kvpress::ops::gather_kv(in.keys, in.values, kv.kept_indices);
  EXPECT_TRUE(at::equal(kv.keys, plain.keys));
  // The formula: rho, the top int(0.25 * 20) = 5 evicted per head, weights rho / max, gamma' = 0.4, exponent 0.25.
  const at::Tensor rho = kvpress::ctr_rescue_scores(in.queries, in.keys, kv.kept_indices);
  at::Tensor w = at::zeros({1, 2, 40});
  for (int64_t h = 0; h < 2; ++h) {
    const at::Tensor top = std::get<1>(rho[0][h].topk(5));
    const at::Tensor picked = rho[0][h].index_select(0, top);
    w[0][h].index_put_({top}, picked / picked.max());
  }
  const at::Tensor expected = kvpress::merge_into_nearest_kept(plain.values, in.values, kv.kept_indices, w, 0.4, 0.75);
  EXPECT_TRUE(at::allclose(kv.values, expected, 1e-6, 1e-6));
  EXPECT_FALSE(at::allclose(kv.values, plain.values));
  c.rescue_ratio = 0.0;
  EXPECT_TRUE(at::equal(CTRPress(0.5, q, c).compress(in).values, plain.values));
}

// ---- registry, errors ---------------------------------------------------------------------------

TEST(CTRPress, RegistryParametersAndDefaults) {
  std::set<std::string> names;
  for (const auto& info : kvpress::list_presses()) names.insert(info.name);
  EXPECT_TRUE(names.count("QSMPress") && names.count("CTRPress"));
  auto qsm = kvpress::make_press("QSMPress", 0.5);
  const QSMOptions& o = dynamic_cast<QSMPress&>(*qsm).options();
  EXPECT_EQ(o.pseudo_query_len, 128);
  EXPECT_EQ(o.sink_tokens, 4);
  EXPECT_EQ(o.recent_tokens, 32);
  EXPECT_DOUBLE_EQ(o.lambda_sem, 0.3);
  EXPECT_DOUBLE_EQ(o.merge_count_power, 0.75);
  auto ctr = kvpress::make_press("CTRPress", 0.3,
                                 {{"entropy", "reference"},
                                  {"rescue_ratio", "0.2"},
                                  {"merge_weighting", "uniform"},
                                  {"rare_token_id_threshold", "1000"},
                                  {"query_length", "16"}});
  const auto& c = dynamic_cast<CTRPress&>(*ctr);
  EXPECT_EQ(c.ctr_options().entropy, CTREntropy::kReference);
  EXPECT_DOUBLE_EQ(c.ctr_options().rescue_ratio, 0.2);
  EXPECT_EQ(c.options().merge_weighting, kvpress::MergeWeighting::kUniform);
  EXPECT_EQ(c.options().semantic.rare_token_id_threshold, 1000);
  EXPECT_EQ(c.options().query_length, 16);
}

TEST(CTRPress, Errors) {
  QSMOptions bad;
  bad.qa_alpha = 1.5;
  expect_error([&] { QSMPress(0.5, bad); }, {"QSMPress: qa_alpha must be in [0, 1], got 1.5"});
  bad = {};
  bad.merge_count_power = 2;
  expect_error([&] { QSMPress(0.5, bad); }, {"merge_count_power must be in [0, 1], got 2"});
  bad = {};
  bad.sink_tokens = -1;
  expect_error([&] { QSMPress(0.5, bad); }, {"sink_tokens must be >= 0, got -1"});
  CTROptions c;
  c.rescue_ratio = 1.5;
  expect_error([&] { CTRPress(0.5, {}, c); }, {"CTRPress: rescue_ratio must be in [0, 1], got 1.5"});
  expect_error(
      [&] {
        kvpress::make_press("CTRPress", 0.5, {{"entropy", "gpu"}});
      },
      {"entropy must be non_forced or reference, got 'gpu'"});
  expect_error(
      [&] {
        kvpress::make_press("QSMPress", 0.5, {{"merge_weighting", "max"}});
      },
      {"merge_weighting must be score or uniform, got 'max'"});
  expect_error(
      [&] {
        kvpress::make_press("QSMPress", 0.5, {{"merge_target", "mean"}});
      },
      {"merge_target must be nearest, got 'mean'"});
  expect_error([&] { kvpress::make_press("QSMPress", 0.5, {{"bogus", "1"}}); }, {"unknown parameter 'bogus'"});

  LayerInputs in = small_layer(2, 2, 16, 4, 5);
  in.input_ids = at::zeros({1, 15}, at::kLong);
  expect_error([&] { QSMPress(0.5, {}, [](int64_t) { return std::string("x"); }).compress(in); },
               {"input_ids must be [1, 16] to match keys, got [1, 15]"});
  in.input_ids = at::zeros({1, 16}, at::kFloat);
  expect_error([&] { QSMPress(0.5).compress(in); }, {"input_ids must be int64 (or int32), got Float"});
  in.input_ids = at::Tensor();
  in.queries = at::Tensor();
  expect_error([&] { QSMPress(0.5).compress(in); }, {"QSMPress.score", "needs attentions, queries, or hidden_states"});

  const at::Tensor v = at::zeros({1, 1, 4, 2});
  expect_error(
      [&] {
        kvpress::merge_into_nearest_kept(at::zeros({1, 1, 2, 2}), v, at::tensor({2L, 1L}).view({1, 1, 2}),
                                         at::ones({1, 1, 4}), 0.2, 0.75);
      },
      {"kept_indices must be strictly ascending"});
  expect_error(
      [&] {
        kvpress::merge_into_nearest_kept(at::zeros({1, 1, 2, 2}), v, at::tensor({0L, 1L}).view({1, 1, 2}),
                                         at::ones({1, 1, 5}), 0.2, 0.75);
      },
      {"weights must be [1, 1, 4], got [1, 1, 5]"});
}

// ---- CUDA ----------------------------------------------------------------------------------------

// The presses are ATen compositions: the same call on a CUDA cache gives the CPU's answer.
TEST(CTRPress, CudaMatchesCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  LayerInputs in = small_layer(8, 2, 200, 16, 41);
  in.input_ids = at::arange(200, at::kLong).unsqueeze(0);
  LayerInputs gpu = in;
  for (at::Tensor* t : {&gpu.keys, &gpu.values, &gpu.queries, &gpu.input_ids}) *t = t->to(at::kCUDA);
  auto text = [](int64_t id) { return id % 5 == 0 ? std::string("Tom") : std::string("a"); };
  QSMOptions q;
  q.query_length = 20;
  for (const char* mode : {"qsm", "ctr", "ctr_reference"}) {
    SCOPED_TRACE(mode);
    CTROptions c;
    c.entropy = std::string(mode) == "ctr_reference" ? CTREntropy::kReference : CTREntropy::kNonForced;
    std::unique_ptr<QSMPress> press = std::string(mode) == "qsm" ? std::make_unique<QSMPress>(0.6, q, text)
                                                                 : std::make_unique<CTRPress>(0.6, q, c, text);
    const kvpress::KV a = press->compress(in), b = press->compress(gpu);
    ASSERT_TRUE(b.values.is_cuda());
    EXPECT_TRUE(at::equal(a.kept_indices, b.kept_indices.cpu()));
    EXPECT_TRUE(at::allclose(a.values, b.values.cpu(), 1e-5, 1e-5));
  }
}

// ---- end to end in the Llama runner -------------------------------------------------------------

TEST(CTRLlama, PrefillDecodeWithQsmAndCtr) {
  const auto model = kvpress::llama::LlamaModel::load(model_dir());
  const at::Tensor ids = reference().get("tiny.input_ids");  // 160 tokens of a held-out story
  const int64_t seq = ids.size(1);
  for (const char* name : {"QSMPress", "CTRPress"}) {
    SCOPED_TRACE(name);
    auto press = kvpress::make_press(name, 0.5);
    auto& qsm = dynamic_cast<QSMPress&>(*press);
    qsm.set_token_text(token_text());
    auto cache = model.new_cache();
    at::Tensor logits;
    const CapturedLayers layers = prefill_with(*press, ids, cache, &logits);
    ASSERT_EQ(layers.inputs.size(), 2u);
    for (int layer = 0; layer < 2; ++layer) {
      const LayerInputs& in = layers.inputs[layer];
      ASSERT_TRUE(in.input_ids.defined());  // the runner passes the token ids
      // The budget formula, recomputed here: n = max(int(S / 2), #forced) (4 sinks + the last 32),
      // then for CTRPress n' = round(n (1 + 0.2 (1 - 2 E / ln N))) over the N non-forced tokens.
      int64_t expected = std::max<int64_t>(seq / 2, 36);
      if (std::string(name) == "CTRPress") {
        const at::Tensor s = qsm.score(in);
        std::vector<double> mean;
        for (int64_t p = 4; p < seq - 32; ++p) mean.push_back(s[0].select(1, p).mean().item<double>());
        const double e = std::clamp(entropy_of(mean) / std::log(static_cast<double>(mean.size())), 0.0, 1.0);
        expected = std::max<int64_t>(36, static_cast<int64_t>(std::nearbyint(expected * (1 + 0.2 * (1 - 2 * e)))));
      }
      EXPECT_EQ(cache.length(layer), expected);
      EXPECT_EQ(layers.outputs[layer].kept_indices.size(2), expected);
      // The cache holds the merged values the press returned (CTRPress rescues into them).
      EXPECT_TRUE(at::equal(cache.values(layer), layers.outputs[layer].values));
      const kvpress::KV plain = kvpress::ops::gather_kv(in.keys, in.values, layers.outputs[layer].kept_indices);
      EXPECT_TRUE(at::equal(cache.keys(layer), plain.keys));
      EXPECT_EQ(at::equal(cache.values(layer), plain.values), std::string(name) == "QSMPress");
    }
    // Greedy decoding over the compressed cache.
    at::Tensor next = logits.narrow(1, logits.size(1) - 1, 1).argmax(-1);
    for (int step = 0; step < 4; ++step) {
      const auto out = model.forward(next, cache);
      ASSERT_TRUE(at::isfinite(out.logits).all().item<bool>());
      next = out.logits.narrow(1, out.logits.size(1) - 1, 1).argmax(-1);
    }
    EXPECT_EQ(cache.position(), seq + 4);
  }
}

// The runner gives a press the tokens' text from PrefillOptions::tokenizer (LayerInputs::token_text):
// a QSMPress without its own text function keeps what one given the same text keeps, and the
// semantic weights change what it keeps (without any text, they are all 1).
TEST(CTRLlama, TheRunnersTokenizerGivesThePressItsText) {
  const auto model = kvpress::llama::LlamaModel::load(model_dir());
  const at::Tensor ids = reference().get("tiny.input_ids");
  const auto kept_with = [&](const kvpress::BasePress& press, const kvpress::llama::Tokenizer* tok) {
    kvpress::llama::PrefillOptions opt;
    opt.press = &press;
    opt.tokenizer = tok;
    std::vector<at::Tensor> kept;
    std::vector<bool> had_text;
    opt.on_compress = [&](const LayerInputs& in, const kvpress::KV& kv) {
      kept.push_back(kv.kept_indices);
      had_text.push_back(static_cast<bool>(in.token_text));
    };
    auto cache = model.new_cache();
    model.prefill(ids, cache, opt);
    EXPECT_EQ(had_text, std::vector<bool>(2, tok != nullptr));
    return kept;
  };
  QSMPress from_runner(0.5);
  QSMPress own(0.5, {}, token_text());
  const auto by_runner = kept_with(from_runner, &tokenizer());
  const auto by_press = kept_with(own, nullptr);
  const auto without = kept_with(from_runner, nullptr);
  bool differs = false;
  for (size_t l = 0; l < by_runner.size(); ++l) {
    EXPECT_TRUE(at::equal(by_runner[l], by_press[l])) << "layer " << l;
    differs = differs || !at::equal(by_runner[l], without[l]);
  }
  EXPECT_TRUE(differs) << "the semantic weights changed nothing: the test cannot tell text from none";
}

}  // namespace
