"""What every benchmark section shares: the run context, result records, progress lines."""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .timing import across, gather, gbps, summary


@dataclass
class Context:
    """One rank's view of the run."""

    opts: Any
    rank: int
    num_ranks: int
    device: torch.device
    group: Any = None
    records: List[Dict[str, Any]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    baseline: str = "NCCL"  # what the all_to_all baselines ran on: "NCCL", or the CPU process group ("gloo")

    def say(self, text: str) -> None:
        """Progress line (rank 0 prints, flushed). The baselines are named after the backend that ran them."""
        if self.rank == 0:
            print(baseline_named(text, self.baseline), flush=True)

    def note(self, text: str) -> None:
        """A remark kept for the report (and printed)."""
        self.say(f"  note: {text}")
        if text not in self.notes:
            self.notes.append(text)


def baseline_label(process_group: str) -> str:
    """The name the tables give the torch.distributed all_to_all baselines: NCCL on GPUs, else the process
    group's backend (gloo on CPUs)."""
    return "NCCL" if process_group == "nccl" else process_group


def baseline_named(text: str, label: str) -> str:
    """`text` (written with NCCL as the baseline) with the baseline's real name."""
    return text if label == "NCCL" else text.replace("[nccl]", f"[{label}]").replace("NCCL", label)


def quiet_fallback_warnings(rank: int) -> None:
    """The reference-backend fallback warning once (rank 0), not once per rank."""
    if rank != 0:
        warnings.filterwarnings("ignore", message="moe_dispatcher: using the reference backend")


def make_record(ctx: Context, fields: Dict[str, Any], times_s: Sequence[float], bytes_logical: int,
                bytes_physical: Optional[int] = None) -> Dict[str, Any]:
    """Gather every rank's timing and bytes of one case into a record (same on every rank).

    t_us: min/mean/max over ranks of each rank's mean call time. logical_gbps / physical_gbps: min/mean/max
    over ranks of (that rank's bytes / its mean time)."""
    local = {"t": summary(times_s), "bytes": float(bytes_logical),
             "phys": None if bytes_physical is None else float(bytes_physical)}
    everyone = gather(local, ctx.group)
    rec = dict(fields)
    rec["t_us"] = across([a["t"]["mean"] for a in everyone])
    rec["t_us_median"] = across([a["t"]["median"] for a in everyone])
    rec["bytes_logical"] = [a["bytes"] for a in everyone]
    rec["logical_gbps"] = across([gbps(a["bytes"], a["t"]["mean"] * 1e-6) for a in everyone])
    if bytes_physical is not None:
        rec["bytes_physical"] = [a["phys"] for a in everyone]
        rec["physical_gbps"] = across([gbps(a["phys"], a["t"]["mean"] * 1e-6) for a in everyone])
    rec["per_rank_us"] = [a["t"] for a in everyone]
    return rec


def attach_baseline(rec: Dict[str, Any], base: Optional[Dict[str, Any]], key: str = "nccl") -> None:
    """Put a baseline's time and GB/s (same byte count) beside a record, with ours/baseline."""
    if base is None:
        return
    rec[key] = {"t_us": base["t_us"], "gbps": base["logical_gbps"], "op": base.get("op")}
    ours, theirs = rec["logical_gbps"]["mean"], base["logical_gbps"]["mean"]
    rec[f"ratio_vs_{key}"] = ours / theirs if theirs > 0 else float("nan")


def fmt_rec(rec: Dict[str, Any]) -> str:
    """One progress line."""
    t = rec["t_us"]
    parts = [f"{t['mean']:9.1f} us (ranks {t['min']:.1f}..{t['max']:.1f})",
             f"{rec['logical_gbps']['mean']:7.1f} GB/s logical"]
    if "physical_gbps" in rec:
        parts.append(f"{rec['physical_gbps']['mean']:6.1f} phys")
    if "nccl" in rec:
        parts.append(f"| NCCL {rec['nccl']['t_us']['mean']:.1f} us {rec['nccl']['gbps']['mean']:.1f} GB/s "
                     f"| ours/NCCL {rec['ratio_vs_nccl']:.2f}")
    return ", ".join(parts[:3]) + (" " + parts[3] if len(parts) > 3 else "")


def env_info(ctx: Context) -> Dict[str, Any]:
    info: Dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "num_ranks": ctx.num_ranks, "process_group": str(dist.get_backend(ctx.group))}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(device=props.name, device_kind=_kind(props.name), sm_count=props.multi_processor_count,
                    cuda=torch.version.cuda, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            info["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            pass
    else:
        info.update(device="cpu", device_kind="cpu")
    return info


def _kind(name: str) -> str:
    """'NVIDIA H200' -> 'h200'."""
    words = [w for w in name.replace("-", " ").split() if w.upper() not in ("NVIDIA", "TESLA", "GEFORCE")]
    return (words[0] if words else name).lower()
