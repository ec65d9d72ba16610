"""GPU smoke test of the build: moe_dispatcher._C loads and its NVSHMEM device state works.

Run on one host with >= 2 GPUs:

    torchrun --nproc_per_node 2 tools/gpu_smoke.py

(NVSHMEM comes up through nvshmem4py when it is importable, else the extension's own init; uninstall
nvshmem4py to exercise the second path). Each rank prints PASS/FAIL
per step; the exit status is non-zero if any step failed on any rank. A watchdog ends a hung run
(MOE_SMOKE_TIMEOUT seconds, default 300).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback

# Keep multicast off in every process (see docs/build.md); set before CUDA/NCCL/NVSHMEM start.
for _key, _value in (
    ("NVSHMEM_DISABLE_NVLS", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
):
    os.environ.setdefault(_key, _value)

import torch  # noqa: E402  (after the environment above is set)
import torch.distributed as dist  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
failures: list[str] = []


def log(msg: str) -> None:
    print(f"[rank {RANK}] {msg}", flush=True)


def step(name: str, fn, *args):
    """Runs one step; prints PASS/FAIL; returns fn's result or None on failure."""
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 -- report every failure, keep going where possible
        failures.append(name)
        log(f"FAIL {name}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return None
    log(f"PASS {name}" + (f": {result}" if isinstance(result, str) else ""))
    return result if result is not None else True


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def main() -> int:
    faulthandler.dump_traceback_later(int(os.environ.get("MOE_SMOKE_TIMEOUT", "300")), exit=True)
    from moe_dispatcher import _ext
    from moe_dispatcher.runtime import nvshmem as shmem

    C = step("import moe_dispatcher._C", lambda: _ext.require("gpu_smoke"))
    if C is None:
        log(f"why: {_ext.why_unavailable()}")
        return 1
    log(
        f"versions: moe_dispatcher {C.version()}, torch {torch.__version__}, "
        f"cuda {C.cuda_version()}, nvshmem {C.nvshmem_version()}"
    )

    torch.cuda.set_device(LOCAL_RANK)
    dist.init_process_group("nccl", device_id=torch.device("cuda", LOCAL_RANK))
    world = dist.get_world_size()
    log(f"bootstrap choice: {os.environ.get(shmem.ENV_BOOTSTRAP, 'auto')}")

    state = step(
        "nvshmem bootstrap",
        lambda: shmem.bootstrap(dist.group.WORLD, LOCAL_RANK, single_host=True),
    )
    if state is not None:
        log(f"state: {state}")

        def idempotent():
            again = shmem.bootstrap(dist.group.WORLD, LOCAL_RANK, single_host=True)
            check(again is state, "second bootstrap returned a different state")
            shmem.finalize()  # drops the extra reference only
            check(shmem.current() is state, "refcounted finalize tore the state down")

        step("bootstrap is idempotent", idempotent)

        def pe_ids():
            check(state.rank == RANK and state.nranks == world, f"PE {state.rank}/{state.nranks}")
            check(C.nvshmem_my_pe() == RANK and C.nvshmem_n_pes() == world, "host PE ids")
            return f"PE {state.rank} of {state.nranks} via {state.backend}"

        step("pe ids", pe_ids)

        nbytes = 1 << 20
        ptr = step("nvshmem_malloc 1 MiB", lambda: state.malloc(nbytes))
        if ptr is not None:

            def peers():
                check(state.peer_ptr(ptr, RANK) == ptr, "nvshmem_ptr(own PE) != ptr")
                missing = [pe for pe in range(world) if state.peer_ptr(ptr, pe) == 0]
                check(not missing, f"PEs not P2P-reachable: {missing}")
                return f"all {world} PEs P2P-reachable"

            step("nvshmem_ptr to every PE", peers)

            def barrier():
                state.barrier()
                torch.cuda.synchronize()

            step("nvshmem_barrier_all on the current stream", barrier)

            def selftest():
                stream = torch.cuda.current_stream().cuda_stream
                wrong = [C.nvshmem_selftest(ptr, nbytes, stream) for _ in range(3)]
                check(wrong == [0, 0, 0], f"wrong words per round: {wrong}")
                return f"3 rounds, {(nbytes - 64) // 8} words each, 0 wrong"

            step("nvshmem_selftest (device state of _C, put-with-signal ring)", selftest)
            step("nvshmem_free", lambda: state.free(ptr))
        step("nvshmem finalize", shmem.finalize)

    # Every rank learns whether any rank failed (NCCL is independent of NVSHMEM).
    failed = torch.tensor([len(failures)], device="cuda")
    dist.all_reduce(failed)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    total = int(failed.item())
    log(("PASS" if total == 0 else "FAIL") + f": {total} failed step(s) across {world} ranks")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
