"""NVLink all-to-all ceilings on one host, to set the intranode kernels' GB/s against (issue 3: "count bytes
against the copy-engine ceiling"). Every GPU sends the same number of bytes to every other GPU at once:

- copy engines: one cudaMemcpyPeerAsync per (source, destination) pair, each on its own stream;
- SM stores: on each source GPU a kernel of `blocks` blocks (512 threads, one per SM) copies its rows into the
  peers' memory with 16-byte loads and stores (the way our kernels move rows), blocks split evenly over the
  peers. Our kernels at num_sms = S send with S / 2 blocks (the other half receive).

Prints, per method, the physical GB/s each GPU pushes out (bytes to peers / time, the median of `iters`
runs) beside what that means in the bench's logical GB/s for 4096 tokens / top-8 / E=256 routing (logical =
physical x R / (R - 1): the bench counts the rows a rank keeps too). Needs CuPy (in the GPU image) and P2P
between the GPUs; one process drives all of them.

    python3 tools/nvlink_ceiling.py [--mib-per-peer 64] [--blocks 6,9,12,15,18,24,30] [--iters 20]
"""
from __future__ import annotations

import argparse
import statistics

_KERNEL = r"""
extern "C" __global__ void push(const int4* __restrict__ src, const unsigned long long* __restrict__ dsts,
                                int num_peers, long long num_vecs) {
  // Block b serves peer b % num_peers; the blocks of one peer stride over its rows together, 4 vectors in
  // flight per thread.
  const int peer = blockIdx.x % num_peers;
  const long long blocks = gridDim.x / num_peers, first = blockIdx.x / num_peers;
  int4* dst = reinterpret_cast<int4*>(dsts[peer]);
  const long long step = blocks * blockDim.x;
  long long i = first * blockDim.x + threadIdx.x;
  for (; i + 3 * step < num_vecs; i += 4 * step) {
    const int4 a = __ldg(src + i), b = __ldg(src + i + step), c = __ldg(src + i + 2 * step),
               d = __ldg(src + i + 3 * step);
    dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
  }
  for (; i < num_vecs; i += step) dst[i] = __ldg(src + i);
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-peer", type=int, default=64)
    ap.add_argument("--blocks", default="6,9,12,15,18,24,30", help="sender blocks per GPU (rounded down to a "
                    "multiple of the peers)")
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
            kernels.append(cp.RawKernel(_KERNEL, "push"))

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

    def sm_stores(wanted: int):
        peers = n - 1
        blocks = max(peers, wanted // peers * peers)
        tables = []
        for i in range(n):
            with cp.cuda.Device(i):
                tables.append(cp.array([dst[j][i].data.ptr for j in range(n) if j != i], dtype=cp.uint64))

        def launch() -> None:
            for i in range(n):
                with cp.cuda.Device(i):
                    kernels[i]((blocks,), (512,), (src[i], tables[i], cp.int32(peers), cp.int64(nbytes // 16)),
                               stream=streams[i][0])
        return launch, blocks

    out_bytes = (n - 1) * nbytes
    scale = n / (n - 1)
    print(f"{n} GPUs, {opts.mib_per_peer} MiB to each peer per GPU; GB/s out per GPU (physical) and as the bench's "
          f"logical GB/s (x {scale:.2f})")
    t = timed(copy_engines)
    print(f"  copy engines           {t * 1e6:9.1f} us  {out_bytes / t / 1e9:7.1f} GB/s  logical {out_bytes / t / 1e9 * scale:7.1f}")
    for wanted in (int(b) for b in opts.blocks.split(",")):
        launch, blocks = sm_stores(wanted)
        t = timed(launch)
        print(f"  SM stores, {blocks:3d} blocks {t * 1e6:9.1f} us  {out_bytes / t / 1e9:7.1f} GB/s  "
              f"logical {out_bytes / t / 1e9 * scale:7.1f}")


if __name__ == "__main__":
    main()
