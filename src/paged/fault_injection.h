// Test hook for PagedKVCache's all-or-nothing promise: makes a device-table upload fail as an
// allocation or a host-to-device copy would. Not part of the public API.
#pragma once

#include <cstdint>

namespace kvpress::detail {

// The next `successes` table uploads of any PagedKVCache succeed and the one after throws a
// c10::Error; a negative value (the default) turns the hook off. Not thread-safe: tests only.
void fail_table_upload_after(int64_t successes);

}  // namespace kvpress::detail
