// Where a timed-out spin-wait reports itself: a struct in host-mapped memory, shared by the device
// (channel.cuh's Watchdog writes it) and the host (which reads it and raises). Plain C++.
#pragma once

#include <cstdint>

namespace moe_ep {

// The first thread that times out fills phase/rank/peer, then a system fence, then status, so the
// host reads consistent fields once it sees status != 0.
struct TimeoutRecord {
  int32_t status;  // 0, or kStatusTimeout
  int32_t phase;   // a protocol-specific phase id
  int32_t rank;    // the rank that waited
  int32_t peer;    // the rank it waited for
};
constexpr int32_t kStatusTimeout = 1;

}  // namespace moe_ep
