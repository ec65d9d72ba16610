"""Cross-rank agreement: the facts of a collective call that every rank must pass alike, as a small int64 vector.

A call's ranks pass their own arguments; nothing but a collective can tell that rank 1 has another hidden size,
dtype, top-k or expert count than rank 0. Before this module such a call crashed gloo (rows of different
widths), or moved bytes that the receivers misread without a word. Now every call that exchanges counts
carries its Signature in that exchange (or, where no exchange of fixed size exists, in one small all-gather of
the signature alone), and `check_agreement` raises the same ValueError on every rank: the operation, each field
that differs, its value on each rank, and the ranks holding each value. Since every rank completed the same
collective before raising, the process group stays usable after a mismatch.

The vector has SIGNATURE_WORDS int64 words, whatever the operation, so that ranks in different operations (one
rank in combine while its peers dispatch) still exchange vectors of one length and learn it:
    word 0: the operation (OPERATIONS);
    word 1: a local problem of this rank (PROBLEMS: 0 none, e.g. a layout that does not match its topk_idx),
            exchanged so that every rank raises it, naming the rank;
    words 2..: the operation's fields, in the order of its FIELDS entry; unused words are 0.
"""
from __future__ import annotations

import bisect
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

SIGNATURE_WORDS = 16

# Operation codes (word 0) and the fields each one compares (words 2.., at most SIGNATURE_WORDS - 2).
OPERATIONS = {1: "Buffer creation", 2: "dispatch", 3: "cached dispatch", 4: "combine", 5: "low-latency dispatch",
              6: "low-latency combine", 7: "expert-major dispatch", 8: "low-latency layout change"}
_CODES = {name: code for code, name in OPERATIONS.items()}
_CONFIG = ("config.num_sms", "config.num_max_nvl_chunked_send_tokens", "config.num_max_nvl_chunked_recv_tokens",
           "config.num_max_rdma_chunked_send_tokens", "config.num_max_rdma_chunked_recv_tokens")
FIELDS: Dict[str, Tuple[str, ...]] = {
    "Buffer creation": ("num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "NVLink domain size", "backend",
                        "num_qps_per_rank", "allow_nvlink_for_low_latency_mode", "explicitly_destroy",
                        "num_pool_bytes", "MOE_DISPATCHER_CHECK_LAYOUT"),
    "dispatch": ("hidden", "x dtype", "x_scales dtype", "x_scales columns", "top-k", "topk_weights given",
                 "num_experts") + _CONFIG,
    "expert-major dispatch": ("hidden", "x dtype", "x_scales dtype", "x_scales columns", "top-k",
                              "topk_weights given", "num_experts") + _CONFIG,
    "cached dispatch": ("handle", "hidden", "x dtype", "x_scales dtype", "x_scales columns") + _CONFIG,
    "combine": ("handle", "hidden", "x dtype", "topk_weights columns") + _CONFIG,
    "low-latency dispatch": ("hidden", "num_max_dispatch_tokens_per_rank", "num_experts", "top-k", "use_fp8",
                             "round_scale", "use_ue8m0"),
    "low-latency combine": ("handle", "hidden", "num_max_dispatch_tokens_per_rank", "num_experts", "top-k",
                            "reduction"),
    # The compiled low-latency runtime's agreement round when a call's buffer layout changes (compiled/low_latency.py).
    "low-latency layout change": ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts"),
}
assert all(len(f) <= SIGNATURE_WORDS - 2 for f in FIELDS.values())

# Codes of the fields that are not plain numbers, and how they read in messages.
DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.int32,
          torch.int64)
_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}
BACKENDS = ("auto", "reference", "kernels")
REDUCTIONS = ("per_rank", "per_expert")
_NAMED = {"x dtype": DTYPES, "x_scales dtype": DTYPES, "backend": BACKENDS, "reduction": REDUCTIONS}
_FLAGS = {"topk_weights given", "low_latency_mode", "allow_nvlink_for_low_latency_mode", "explicitly_destroy",
          "use_fp8", "round_scale", "use_ue8m0", "MOE_DISPATCHER_CHECK_LAYOUT"}

# Local problems (word 1): found by one rank in its own arguments, raised by every rank.
PROBLEMS = {
    1: "num_tokens_per_rank does not match is_token_in_rank",
    2: "the layout (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert) is not the one "
       "get_dispatch_layout gives for its topk_idx",
    3: "num_tokens_per_expert does not add up to num_tokens_per_rank (each token sent to a rank counts once "
       "there, and at most once per expert of that rank)",
    # Found on the GPU by the layout kernel (get_dispatch_layout) and reported by the next dispatch's notify.
    4: "get_dispatch_layout was given expert ids outside [-1, num_experts) (their slots were dropped)",
    5: "get_dispatch_layout was given a token naming one expert twice (it was counted twice)",
    # Found on the GPU by the receivers of a cached call (compiled intranode kernels: a source's ring signature
    # differed) and reported by the next dispatch's notify; ring_disagreement names the fields.
    6: "a cached dispatch or combine along a handle received rows laid out by another rank's arguments (its "
       "receivers read none of them)",
}
PROBLEM_RING_SIGNATURE = 6
# Rows of the ring records a rank contributes to the error of problem 6: (source, source's word, own word).
RING_RECORDS = 8


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """The signature code of a dtype (0: no tensor); dtypes outside DTYPES get codes past its end, by name."""
    code = _DTYPE_CODES.get(dtype)
    return code if code is not None else len(DTYPES) + sum(map(ord, str(dtype)))


class Signature:
    """One call's facts: `operation` (a name of OPERATIONS), its fields' values (ints, or dtypes / names of
    _NAMED fields) in FIELDS order, and `problem` (a PROBLEMS code, 0 for none)."""

    __slots__ = ("operation", "values", "problem")

    def __init__(self, operation: str, values: Sequence, problem: int = 0) -> None:
        fields = FIELDS[operation]
        if len(values) != len(fields):
            raise ValueError(f"signature of {operation}: {len(values)} values for {len(fields)} fields")
        self.operation, self.problem = operation, problem
        self.values = [_encode(name, v) for name, v in zip(fields, values)]

    def words(self) -> List[int]:
        """The SIGNATURE_WORDS int64 words exchanged (module docstring)."""
        out = [_CODES[self.operation], self.problem] + self.values
        return out + [0] * (SIGNATURE_WORDS - len(out))

    def tensor(self, device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """int64 [SIGNATURE_WORDS]."""
        return torch.tensor(self.words(), dtype=torch.int64, device=device)


def _encode(field: str, value) -> int:
    if field in ("x dtype", "x_scales dtype"):
        return dtype_code(value)
    if field in _NAMED:
        return _NAMED[field].index(value)
    if isinstance(value, torch.dtype):
        raise TypeError(f"signature field {field} takes no dtype")
    return int(value)


def _show(field: str, code: int) -> str:
    """How a field's value reads in messages."""
    if field in _NAMED:
        names = _NAMED[field]
        if 0 <= code < len(names):
            value = names[code]
            if value is None:
                return "none"
            return str(value).replace("torch.", "")
        return f"code {code}"
    if field in _FLAGS:
        return "yes" if code else "no"
    if field == "NVLink domain size" and code == 0:
        return "from hostnames"
    return str(code)


def _by_value(column: Sequence[int]) -> Dict[int, List[int]]:
    """value -> ranks holding it, values in order of first appearance."""
    groups: Dict[int, List[int]] = {}
    for rank, v in enumerate(column):
        groups.setdefault(v, []).append(rank)
    return groups


def _values_text(field: str, column: Sequence[int]) -> str:
    groups = _by_value(column)
    return "; ".join(f"{_show(field, v)} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for v, r in groups.items())


def disagreement(table: torch.Tensor) -> str:
    """The error text of a [R, SIGNATURE_WORDS] table of the ranks' signatures ("" when they agree): every field
    that differs, with its values and the ranks holding each; a local problem of any rank, naming the rank."""
    rows = table.to(torch.int64).cpu().tolist()
    ops = [row[0] for row in rows]
    if len(set(ops)) > 1:
        groups = _by_value(ops)
        where = "; ".join(f"{OPERATIONS.get(op, f'operation {op}')} on rank{'s' if len(r) > 1 else ''} "
                          f"{', '.join(map(str, r))}" for op, r in groups.items())
        return f"the ranks are in different calls: {where}"
    operation = OPERATIONS[ops[0]]
    parts = []
    for i, field in enumerate(FIELDS[operation]):
        column = [row[2 + i] for row in rows]
        if len(set(column)) > 1:
            parts.append(f"{field} differs: {_values_text(field, column)}")
    for rank, row in enumerate(rows):
        if row[1]:
            parts.append(f"on rank {rank}, {PROBLEMS.get(row[1], f'problem {row[1]}')}")
    if not parts:
        return ""
    return f"{operation}: the ranks' calls do not agree: " + "; ".join(parts)


class SignatureMismatch(ValueError):
    """The ranks of a call passed arguments that do not agree (raised alike on every rank, after the same
    collective: the process group stays usable, and no rank posts it as an abort to its peers)."""

    raised_on_every_rank = True


def check_agreement(table: torch.Tensor) -> None:
    """Raise SignatureMismatch on this rank (every rank calls it on the same table, so all raise alike)."""
    text = disagreement(table)
    if text:
        raise SignatureMismatch(text)


def dispatch_signature(operation: str, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                       topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], num_experts: int,
                       config, problem: int = 0) -> Signature:
    """The Signature of a fresh dispatch ("dispatch" or "expert-major dispatch"); config: the effective one."""
    return Signature(operation, (
        x.shape[1], x.dtype, x_scales.dtype if x_scales is not None else None,
        x_scales.shape[1] if x_scales is not None else 0, topk_idx.shape[1] if topk_idx is not None else 0,
        topk_weights is not None, num_experts, *config_values(config)), problem)


def signature_hash(signature: Signature) -> int:
    """A signed 32-bit hash of the words every rank must pass alike (all but the problem word): what the compiled
    kernels' notify messages carry. Python's hash of a tuple of ints is the same in every process (only str and
    bytes hashes are salted), and cheap (about 1 us; a fresh dispatch computes one)."""
    h = hash((_CODES[signature.operation], *signature.values)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class KeptSignatures:
    """The signatures of a compiled backend's fresh dispatches by call number (seq), kept for the error of a
    disagreement that notify recorded and the host reports later (raise_disagreement): a num_worst_tokens call is
    reported at the next synchronised dispatch or at Buffer.check_refused_calls, which may come a whole training
    step of calls later. Consecutive calls with equal signatures share one entry (a run), so the latest `runs`
    changes of signature are kept however many calls each spans: a training step repeats one signature for
    every layer's and microbatch's dispatch, and a call that differs starts a run of its own on the rank that
    passed it. Cost per call: one comparison with the latest run's signature (a dozen ints)."""

    __slots__ = ("runs", "_starts", "_signatures", "_latest")

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self._starts: List[int] = []  # the first seq of each kept run, ascending
        self._signatures: List[Signature] = []
        self._latest = 0  # the seq added last

    def add(self, seq: int, signature: Signature) -> None:
        """The signature of call `seq` (larger than every seq added before, unless the numbers wrapped)."""
        if seq <= self._latest:  # the call numbers wrapped: the kept runs no longer sort before it
            self._starts.clear()
            self._signatures.clear()
        self._latest = seq
        if self._signatures:
            last = self._signatures[-1]
            if (last.values == signature.values and last.operation == signature.operation
                    and last.problem == signature.problem):
                return
        self._starts.append(seq)
        self._signatures.append(signature)
        if len(self._starts) > self.runs:
            del self._starts[0], self._signatures[0]

    def get(self, seq: int) -> Optional[Signature]:
        """The signature of call `seq`, or None when it is older than the kept runs or was never added."""
        if seq > self._latest:
            return None
        i = bisect.bisect_right(self._starts, seq) - 1
        return self._signatures[i] if i >= 0 else None


def raise_disagreement(group, device: torch.device, signatures: Union[KeptSignatures, Dict[int, Signature]],
                       seq: int, problems: Sequence[int],
                       ring_records: Callable[[], Sequence[Tuple[int, int, int]]] = list,
                       nvl_size: Optional[int] = None) -> None:
    """Collective, on every rank of `group` alike: a compiled notify found call `seq`'s signatures differing
    (hashes) or a rank's problem word set (`problems`, one per rank, from the mailbox). One all-gather of the
    full signatures (`signatures`: this rank's by seq, a KeptSignatures; every rank kept the same seqs) names
    the fields; where a rank reported PROBLEM_RING_SIGNATURE, one more all-gather of every rank's ring_records()
    (source, the source's ring signature, this rank's: what its receivers recorded) names the fields of the
    cached call.
    ring_records() takes (clears) the records, so only a rank whose own word was PROBLEM_RING_SIGNATURE calls
    it: a rank that sent another problem kept its ring flag on the device, and its next notify reports that
    with these records. nvl_size: the NVLink domain size of an internode group (ring_disagreement), else None.
    Raises SignatureMismatch."""
    import torch.distributed as dist

    mine = signatures.get(seq)
    row = (mine.tensor(device) if mine is not None
           else torch.zeros(SIGNATURE_WORDS, dtype=torch.int64, device=device))
    table = torch.empty(dist.get_world_size(group), SIGNATURE_WORDS, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(table, row, group=group)
    table = table.cpu()
    table[:, 1] = torch.tensor(list(problems), dtype=torch.int64)  # the kernels' problem words are the ones sent
    text = disagreement(table) if mine is not None else ""
    if not text:
        text = "the ranks' calls do not agree (their signature hashes differ)"
    if PROBLEM_RING_SIGNATURE in problems:  # every rank has the same problems: all gather alike
        mine_records = torch.zeros(RING_RECORDS, 3, dtype=torch.int64)
        taken = ring_records() if problems[dist.get_rank(group)] == PROBLEM_RING_SIGNATURE else ()
        for i, record in enumerate(list(taken)[:RING_RECORDS]):
            mine_records[i] = torch.tensor(record, dtype=torch.int64)
        records = torch.empty(dist.get_world_size(group), RING_RECORDS, 3, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(records, mine_records.to(device), group=group)
        for rank, rows in enumerate(records.cpu().tolist()):
            found = [tuple(r) for r in rows if r[1] != 0]
            if found:
                text += f"; {ring_disagreement(rank, found, nvl_size)}"
    raise SignatureMismatch(f"{text} (found by the notify of fresh dispatch {seq} of this Buffer; a call with "
                            f"num_worst_tokens reports at the next dispatch without it, or at "
                            f"Buffer.check_refused_calls)")


# The ring signature of a cached call (compiled intranode kernels, docs/intranode.md "Agreement"; internode, one
# word per hop, docs/internode.md): the fields of the call's signature that fix a ring's slot layout, packed into
# one nonzero 64-bit word (bit 63 clear) that each sender stores next to its ring and each receiver compares with
# its own before it reads a slot. The slot count field holds the slots of the hop's rings: NVLink rings
# (config.num_max_nvl_chunked_recv_tokens), or internode RDMA rings (RDMA_SLOTS_FIELD). Fields in
# FIELDS names, (first bit, width); a dtype outside DTYPES is coded by its element size (_ring_dtype), and numbers
# wider than their width are clamped to its maximum (far past every kernel limit: such calls fail their checks first).
RING_FIELDS: Tuple[Tuple[str, int, int], ...] = (
    ("operation", 0, 3), ("x dtype", 3, 5), ("x_scales dtype", 8, 5), ("x_scales columns", 13, 10),
    ("topk_weights columns", 23, 5), ("hidden", 28, 20), ("config.num_max_nvl_chunked_recv_tokens", 48, 15))


RDMA_SLOTS_FIELD = "config.num_max_rdma_chunked_recv_tokens"


def ring_signature_word(operation: str, hidden: int, x_dtype: torch.dtype, scales_dtype: Optional[torch.dtype],
                        scales_columns: int, topk_weights_columns: int, ring_slots: int) -> int:
    """The ring signature of a cached call: operation "cached dispatch" (top-k weights columns 0) or "combine"
    (no scales); ring_slots: the slots of the hop's rings (config.num_max_nvl_chunked_recv_tokens, or for the
    internode RDMA hop config.num_max_rdma_chunked_recv_tokens)."""
    values = (_CODES[operation], _ring_dtype(x_dtype), _ring_dtype(scales_dtype), scales_columns,
              topk_weights_columns, hidden, ring_slots)
    word = 0
    for (_, shift, width), v in zip(RING_FIELDS, values):
        word |= min(int(v), (1 << width) - 1) << shift
    return word


# A dtype outside DTYPES in a ring signature's 5-bit field: this base plus log2 of its element bytes (its DTYPES
# code would be clamped, and two such dtypes of other sizes would lay rows out alike in the word).
_RING_OTHER_DTYPE = 24


def _ring_dtype(dtype: Optional[torch.dtype]) -> int:
    """A dtype's code in a ring signature: its DTYPES code, else _RING_OTHER_DTYPE + log2(element bytes)."""
    code = dtype_code(dtype)
    return code if code < len(DTYPES) else _RING_OTHER_DTYPE + dtype.itemsize.bit_length() - 1


def _show_ring(field: str, code: int) -> str:
    """How a ring signature field's value reads in messages."""
    if field in _NAMED and code >= _RING_OTHER_DTYPE:
        return f"a {1 << (code - _RING_OTHER_DTYPE)}-byte dtype"
    return _show(field, code)


def _ring_fields(word: int) -> Dict[str, int]:
    return {name: (word >> shift) & ((1 << width) - 1) for name, shift, width in RING_FIELDS}


def ring_disagreement(rank: int, records: Sequence[Tuple[int, int, int]], nvl_size: Optional[int] = None) -> str:
    """The error text of the ring signatures this rank's receivers found differing: records (source rank, the
    source's word, this rank's word) of one or more sources. nvl_size (internode): a source outside this rank's
    NVLink domain sent over the RDMA hop, whose word carries the RDMA ring slots."""
    parts = []
    for source, sent, expected in records:
        theirs, mine = _ring_fields(sent), _ring_fields(expected)
        if theirs["operation"] != mine["operation"]:
            ops = [OPERATIONS.get(v, f"operation {v}") for v in (mine["operation"], theirs["operation"])]
            parts.append(f"the ranks are in different calls: {ops[0]} on rank {rank}; {ops[1]} on rank {source}")
            continue
        rdma_hop = nvl_size is not None and source // nvl_size != rank // nvl_size
        fields = [f"{RDMA_SLOTS_FIELD if rdma_hop and name == RING_FIELDS[-1][0] else name} differs: "
                  f"{_show_ring(name, mine[name])} on rank {rank}; {_show_ring(name, theirs[name])} "
                  f"on rank {source}" for name, _, _ in RING_FIELDS[1:] if theirs[name] != mine[name]]
        parts.append("; ".join(fields) or f"the ring signatures of ranks {rank} and {source} differ")
    operation = OPERATIONS.get(_ring_fields(records[0][2])["operation"], "cached call")
    return (f"{operation}: the ranks' calls do not agree: " + "; ".join(parts) +
            f" (found by rank {rank}'s receivers, which read no row of a disagreeing rank)")


def config_values(config) -> Tuple[int, int, int, int, int]:
    """The Config fields a signature carries (the call's effective config)."""
    return (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)
