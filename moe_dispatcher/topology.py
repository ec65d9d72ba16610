"""Which ranks of a process group share an NVLink domain.

A domain is a block of consecutive group ranks whose GPUs reach each other over NVLink (one host, here).
Intranode kernels serve a single domain; internode kernels move tokens between domains over NVSHMEM, to the
GPU of the same local index, and forward them over NVLink inside the domain.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .env import differing_setting, env_int, env_raw
from .validation import check_count

if TYPE_CHECKING:
    from .reference.board import Board

MAX_NVL_SIZE = 8
NVL_SIZE_ENV = "MOE_DISPATCHER_NVL_SIZE"
EXCHANGE_STEP = "topology exchange"  # the creation round's name (errors name it)


def exchange(group: Optional[dist.ProcessGroup], board: Optional[Board] = None) -> List[Tuple[str, str]]:
    """Collective: every rank's (hostname, raw MOE_DISPATCHER_NVL_SIZE) of `group`, in rank order; a setting that
    differs between the ranks raises ValueError on every rank, naming each rank's value.

    One bounded round (reference.board's Board.creation_round, step EXCHANGE_STEP) on `board`: a Buffer's at its
    creation, else a board of the group's own for topology exchanges (numbered apart from the Buffers'). A rank
    that does not come within MOE_DISPATCHER_TIMEOUT_S (default 300 s), or fails to tell its hostname, makes every
    rank that came raise CreationFailed naming it and the step. (A group whose store torch does not expose:
    one all_gather_object, unbounded.)"""
    operation = "Buffer creation"
    if board is None:
        from .reference.board import Board  # here: the reference package imports config, which imports this module
        board = Board(group, dist.get_rank(group), dist.get_world_size(group), kind="topology")
        operation = "Topology.from_group"
    try:
        facts, error = (socket.gethostname(), env_raw(NVL_SIZE_ENV)), None
    except Exception as exc:  # noqa: BLE001 - the peers learn it in the round instead of waiting for this rank
        facts, error = None, exc
    gathered = board.creation_round(EXCHANGE_STEP, error, facts, operation)
    # A setting that differs raises on every rank (each read the same posts): a variable set on some ranks only
    # would otherwise give the ranks different domains.
    differing = differing_setting(NVL_SIZE_ENV, [setting for _, setting in gathered], "the group")
    if differing is not None:
        raise differing
    return gathered


@dataclass(frozen=True)
class Topology:
    """rank / num_ranks: this process in the group; nvl_size: ranks per NVLink domain (divides num_ranks)."""

    rank: int
    num_ranks: int
    nvl_size: int
    source: str = "given"  # how nvl_size was found: "given", "env" or "hostnames"

    def __post_init__(self) -> None:
        for name, minimum in (("rank", 0), ("num_ranks", 1), ("nvl_size", 1)):
            check_count(f"Topology.{name}", getattr(self, name), minimum)
        if self.num_ranks <= 0 or not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"Topology: rank {self.rank} is not in a group of {self.num_ranks}")
        if self.nvl_size <= 0 or self.num_ranks % self.nvl_size:
            raise ValueError(f"Topology: NVLink domain size {self.nvl_size} ({self.source}) must divide the "
                             f"group size {self.num_ranks}")
        if self.nvl_size > MAX_NVL_SIZE:
            raise ValueError(f"Topology: NVLink domain size {self.nvl_size} ({self.source}) exceeds {MAX_NVL_SIZE}, "
                             f"the most GPUs one domain may hold; set {NVL_SIZE_ENV} to split it")

    @property
    def num_domains(self) -> int:
        return self.num_ranks // self.nvl_size

    @property
    def domain(self) -> int:
        return self.rank // self.nvl_size

    @property
    def local_index(self) -> int:
        return self.rank % self.nvl_size

    @property
    def is_single_domain(self) -> bool:
        return self.num_domains == 1

    def domain_ranks(self, domain: Optional[int] = None) -> range:
        """Group ranks of `domain` (default: this rank's)."""
        d = self.domain if domain is None else domain
        return range(d * self.nvl_size, (d + 1) * self.nvl_size)

    @classmethod
    def from_hostnames(cls, rank: int, hostnames: Sequence[str]) -> "Topology":
        """Domains = runs of consecutive ranks on one host; every host must hold one equal-sized run."""
        n = len(hostnames)
        runs, start = [], 0
        for i in range(1, n + 1):
            if i == n or hostnames[i] != hostnames[start]:
                runs.append((hostnames[start], i - start))
                start = i
        hosts = [h for h, _ in runs]
        if len(set(hosts)) != len(hosts):
            raise ValueError(f"Topology: the ranks of a host must be consecutive in the group; got hosts "
                             f"{list(hostnames)}. Reorder the group or set {NVL_SIZE_ENV}")
        sizes = {s for _, s in runs}
        if len(sizes) != 1:
            raise ValueError(f"Topology: hosts hold different numbers of ranks {[s for _, s in runs]}; the "
                             f"kernels need equal NVLink domains. Set {NVL_SIZE_ENV} to choose one")
        return cls(rank, n, sizes.pop(), "hostnames")

    @classmethod
    def from_group(cls, group: Optional[dist.ProcessGroup] = None, nvl_size: Optional[int] = None,
                   board: Optional[Board] = None) -> "Topology":
        """Topology of `group` (default: the world). Collective unless `nvl_size` is given (`exchange`: every rank's
        hostname and MOE_DISPATCHER_NVL_SIZE are gathered, bounded with a `board`; a variable that differs
        between ranks raises ValueError on every rank).

        Order of precedence: the `nvl_size` argument, the environment variable MOE_DISPATCHER_NVL_SIZE
        (emulate several domains on one host, or describe an unusual cluster), the hostnames of the ranks.
        """
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        if nvl_size is not None:
            return cls(rank, num_ranks, check_count("nvl_size", nvl_size, 1), "given")
        # One exchange whatever the source, of every rank's hostname and setting: a variable set on some ranks
        # only would otherwise leave the others alone in the hostname gather.
        gathered = exchange(group, board)
        size = env_int(NVL_SIZE_ENV, None, minimum=1)
        if size is not None:
            return cls(rank, num_ranks, size, "env")
        return cls.from_hostnames(rank, [hostname for hostname, _ in gathered])
