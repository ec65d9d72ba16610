"""NVLink all-to-all ceilings on one host, to set the intranode kernels' GB/s against (issue 3: "count bytes
against the copy-engine ceiling"). Every GPU sends the same number of bytes to every other GPU at once:

- copy engines: one cudaMemcpyPeerAsync per (source, destination) pair, each on its own stream;
- SM stores: on each source GPU a kernel of `blocks` blocks (`--threads` threads each, default 512, one block per
  SM) copies its rows into the peers' memory with 16-byte loads and stores (the way our kernels move rows),
  `--loads` loads in flight per thread (default 4), blocks split evenly over the peers. The ring kernels at
  num_sms = S send with S / 2 blocks (the other half receive); the direct dispatch sends with all S.

Per method and shape it prints the physical GB/s each GPU pushes out (bytes to peers / time, the median of `iters`
runs), that per sending block (an SM's share), and what it means in the bench's logical GB/s for 4096 tokens /
top-8 / E=256 routing (logical = physical x R / (R - 1): the bench counts the rows a rank keeps too). Needs CuPy
(in the GPU image) and P2P between the GPUs; one process drives all of them.

    python3 tools/nvlink_ceiling.py [--mib-per-peer 64] [--blocks 6,9,12,15,18,24,30] [--threads 512]
                                    [--loads 4] [--iters 20]

--threads and --loads take comma lists too: every combination is measured.
"""
from __future__ import annotations

import argparse
import statistics

_KERNEL = r"""
extern "C" __global__ void push(const int4* __restrict__ src, const unsigned long long* __restrict__ dsts,
                                int num_peers, long long num_vecs) {
  // Block b serves peer b % num_peers; the blocks of one peer stride over its rows together, LOADS vectors in
  // flight per thread.
  const int peer = blockIdx.x % num_peers;
  const long long blocks = gridDim.x / num_peers, first = blockIdx.x / num_peers;
  int4* dst = reinterpret_cast<int4*>(dsts[peer]);
  const long long step = blocks * blockDim.x;
  long long i = first * blockDim.x + threadIdx.x;
  for (; i + (LOADS - 1) * step < num_vecs; i += LOADS * step) {
    int4 v[LOADS];
#pragma unroll
    for (int u = 0; u < LOADS; ++u) v[u] = __ldg(src + i + u * step);
#pragma unroll
    for (int u = 0; u < LOADS; ++u) dst[i + u * step] = v[u];
  }
  for (; i < num_vecs; i += step) dst[i] = __ldg(src + i);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-peer", type=int, default=64)
    ap.add_argument("--blocks", default="6,9,12,15,18,24,30", help="sender blocks per GPU (rounded down to a "
                    "multiple of the peers)")
    ap.add_argument("--threads", default="512", help="threads per block (comma list)")
    ap.add_argument("--loads", default="4", help="16-byte loads in flight per thread (comma list)")
    ap.add_argument("--iters", type=int, default=20)
    opts = ap.parse_args()
    import cupy as cp

    n = cp.cuda.runtime.getDeviceCount()
    if n < 2:
        raise SystemExit("needs at least 2 GPUs")
    nbytes = opts.mib_per_peer << 20
    for i in range(n):
        for j in range(n):
            if i != j:
                with cp.cuda.Device(i):
                    try:
                        cp.cuda.runtime.deviceEnablePeerAccess(j)
                    except cp.cuda.runtime.CUDARuntimeError:
                        pass  # already enabled
    src, dst, streams, kernels = [], [], [], []
    for i in range(n):
        with cp.cuda.Device(i):
            src.append(cp.ones(nbytes // 4, dtype=cp.int32))
            # dst[i][j]: where GPU j's rows land on GPU i
            dst.append([cp.zeros(nbytes // 4, dtype=cp.int32) for _ in range(n)])
            streams.append([cp.cuda.Stream(non_blocking=True) for _ in range(n)])
            kernels.append({u: cp.RawKernel(f"#define LOADS {u}\n" + _KERNEL, "push")
                            for u in (int(x) for x in opts.loads.split(","))})

    def timed(launch) -> float:
        """Median seconds of one all-to-all: every GPU starts after a barrier of events, ends when all did."""
        times = []
        for it in range(opts.iters + 2):
            for i in range(n):
                cp.cuda.Device(i).synchronize()
            starts, ends = [], []
            for i in range(n):
                with cp.cuda.Device(i):
                    s, e = cp.cuda.Event(), cp.cuda.Event()
                    s.record(streams[i][0])
                    for st in streams[i][1:]:
                        st.wait_event(s)
                    starts.append(s)
                    ends.append(e)
            launch()
            for i in range(n):
                with cp.cuda.Device(i):
                    for st in streams[i][1:]:
                        ev = cp.cuda.Event()
                        ev.record(st)
                        streams[i][0].wait_event(ev)
                    ends[i].record(streams[i][0])
            for i in range(n):
                ends[i].synchronize()
            if it >= 2:
                times.append(max(cp.cuda.get_elapsed_time(starts[i], ends[i]) for i in range(n)) / 1e3)
        return statistics.median(times)

    def copy_engines() -> None:
        for i in range(n):
            with cp.cuda.Device(i):
                for k, j in enumerate(x for x in range(n) if x != i):
                    cp.cuda.runtime.memcpyPeerAsync(dst[j][i].data.ptr, j, src[i].data.ptr, i, nbytes,
                                                    streams[i][k].ptr)

    def sm_stores(wanted: int, threads: int, loads: int):
        peers = n - 1
        blocks = max(peers, wanted // peers * peers)
        tables = []
        for i in range(n):
            with cp.cuda.Device(i):
                tables.append(cp.array([dst[j][i].data.ptr for j in range(n) if j != i], dtype=cp.uint64))

        def launch() -> None:
            for i in range(n):
                with cp.cuda.Device(i):
                    kernels[i][loads]((blocks,), (threads,),
                                      (src[i], tables[i], cp.int32(peers), cp.int64(nbytes // 16)),
                                      stream=streams[i][0])
        return launch, blocks

    out_bytes = (n - 1) * nbytes
    scale = n / (n - 1)
    print(f"{n} GPUs, {opts.mib_per_peer} MiB to each peer per GPU; GB/s out per GPU (physical) and as the bench's "
          f"logical GB/s (x {scale:.2f})")
    t = timed(copy_engines)
    gbs = out_bytes / t / 1e9
    print(f"  copy engines           {t * 1e6:9.1f} us  {gbs:7.1f} GB/s  logical {gbs * scale:7.1f}")
    for threads in (int(x) for x in opts.threads.split(",")):
        for loads in (int(x) for x in opts.loads.split(",")):
            for wanted in (int(b) for b in opts.blocks.split(",")):
                launch, blocks = sm_stores(wanted, threads, loads)
                t = timed(launch)
                gbs = out_bytes / t / 1e9
                print(f"  SM stores, {blocks:3d} blocks x {threads:4d} threads x {loads} loads {t * 1e6:9.1f} us  "
                      f"{gbs:7.1f} GB/s ({gbs / blocks:5.1f} a block)  logical {gbs * scale:7.1f}")

if __name__ == "__main__":
    main()
