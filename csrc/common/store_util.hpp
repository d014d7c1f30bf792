// Small helpers over c10d::Store shared by the plans, the transports and the
// shared-memory setup.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace fastcomm {

// The value of `key` as text; waits for the key as Store::get does. Our keys
// hold text (handles, plans, host ids, error messages), while the store
// returns raw bytes.
inline std::string storeGet(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  const std::vector<uint8_t> v = store->get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace fastcomm
