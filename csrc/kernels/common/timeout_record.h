// Where a spin-wait that gave up reports itself: a struct in host-mapped memory, shared by the device
// (wait.cuh's Watchdog writes it) and the host (which reads it and raises). Plain C++.
#pragma once

#include <cstdint>

namespace moe_ep {

// The first thread that times out fills phase/rank/peer, then a system fence, then status, so the
// host reads consistent fields once it sees status != 0.
struct TimeoutRecord {
  int32_t status;  // 0, kStatusTimeout or kStatusPeerAborted
  int32_t phase;   // a protocol-specific phase id
  int32_t rank;    // the rank that waited
  int32_t peer;    // kStatusTimeout: the rank it waited for; kStatusPeerAborted: the rank whose abort it honoured
};
constexpr int32_t kStatusTimeout = 1;
constexpr int32_t kStatusPeerAborted = 2;  // a peer raised in a Buffer call and posted its abort byte (wait.cuh)

// The abort bytes of a rank: uint8 [kMaxAbortRanks] in its peer-writable memory (the NVLink buffer's Control,
// internode's RdmaControl, after the low-latency halves), byte p written by peer p's host only (1: p raised in
// a Buffer call, 0: p came back). Zeroed at creation with the rest of the control words.
constexpr int kMaxAbortRanks = 64;

}  // namespace moe_ep
