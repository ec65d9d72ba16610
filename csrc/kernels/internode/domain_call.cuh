// The NVLink domain as intranode's direct-call protocol (intranode/direct_call.cuh) sees it: the internode kernels
// that use the domain peers' pool blocks in place (dispatch.cu's direct NVLink hop, combine.cu's pull NVLink hop)
// run that protocol over the domain, on the words of the internode NVLink buffer's Control, indexed by local rank.
#pragma once

#include "kernels/internode/common.cuh"
#include "kernels/intranode/direct_call.cuh"

namespace moe_ep::internode {

// One thread: the domain's view into `d` (shared memory: a copy per thread would live on the stack): its NVLink
// buffers, indexed by local rank; rank = my local index.
__device__ __forceinline__ void set_domain_common(intranode::Common& d, const Common& c) {
  for (int j = 0; j < kMaxNvl; ++j) d.peers[j] = c.nvl[j];
  d.rank = c.local;
  d.num_ranks = c.nvl_size;
  d.mailbox = c.mailbox;
  d.timeout_ns = c.timeout_ns;
  d.src_block_bytes = 0;
}

}  // namespace moe_ep::internode
