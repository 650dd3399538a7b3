#include "kvpress/presses/lagkv_press.h"

#include "checks.h"

namespace kvpress {

LagKVPress::LagKVPress(double compression_ratio, int64_t n_sink, int64_t lag_size, bool cross_scoring)
    : ScorerPress(compression_ratio), n_sink_(n_sink), lag_size_(lag_size), cross_scoring_(cross_scoring) {
  checks::check_non_negative("LagKVPress", "n_sink", n_sink);
  checks::check_positive("LagKVPress", "lag_size", lag_size);
}

}  // namespace kvpress
