// Glue that the intranode and internode bindings share: both kernels' notify takes the same count inputs,
// and both record a timeout in the mailbox of the NVLink domain's IpcBuffer (each with its own phases).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings.h"
#include "runtime/ipc_buffer.h"

namespace moe_ep {

// (status, phase name, waiting rank, peer) of the first wait of this rank that gave up, as recorded in `b`'s
// mailbox (status kStatusTimeout: peer is the rank it waited for; kStatusPeerAborted: the rank whose abort it
// honoured), or None; phase_name(phase) words the backend's phase codes.
inline pybind11::object mailbox_timeout_info(const IpcBuffer& b, std::string (*phase_name)(int)) {
  const volatile TimeoutRecord* rec = &b.host_mailbox()->timeout;
  if (rec->status == 0) return pybind11::none();
  return pybind11::make_tuple(static_cast<int>(rec->status), phase_name(rec->phase), static_cast<int>(rec->rank),
                              static_cast<int>(rec->peer));
}

// The inputs and outputs of notify that the intranode and internode NotifyArgs name alike.
template <typename NotifyArgsT>
void set_notify_counts(NotifyArgsT& a, uintptr_t is_token_in_rank, uintptr_t num_tokens_per_rank,
                       uintptr_t num_tokens_per_expert, int num_tokens, int num_experts, int num_channels,
                       int expert_alignment, int num_worst_tokens, int seq, uintptr_t rank_prefix_matrix,
                       uintptr_t recv_channel_offset) {
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.num_tokens_per_rank = ptr<const int>(num_tokens_per_rank);
  a.num_tokens_per_expert = ptr<const int>(num_tokens_per_expert);
  a.num_tokens = num_tokens;
  a.num_experts = num_experts;
  a.num_channels = num_channels;
  a.expert_alignment = expert_alignment;
  a.num_worst_tokens = num_worst_tokens;
  a.seq = seq;
  a.rank_prefix_matrix = ptr<int>(rank_prefix_matrix);
  a.recv_channel_offset = ptr<int>(recv_channel_offset);
}

}  // namespace moe_ep
