"""Input checks shared by every backend. They run before any communication or kernel launch, so a bad
argument raises on every rank the same way instead of leaving peers waiting in a collective.

TypeError: wrong Python type or dtype. ValueError: wrong shape, device, layout or value.
Counts (sizes, token and expert numbers, Config fields) must be Python ints: bools are refused (True is not a
count), and so are floats, strings and numpy / torch scalars (pass int(value)): the compiled backends hand
them to native code, which takes plain ints only.
Value checks (expert ids in range, no repeated expert in a token) read tensor contents, which on a GPU costs a
host synchronisation; callers on sync-free paths pass `values=False`.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_DTYPES = (torch.float32, torch.int32)
# Most top-k slots per token: the kernels are compiled for it (MAX_TOPK of csrc/kernels/common), and
# config.py sizes the normal-mode ring slots for it.
MAX_TOPK = 16


def check_count(name: str, value, minimum: int = 0) -> int:
    """A count argument: a Python int (not a bool) >= minimum. TypeError / ValueError name the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = "" if isinstance(value, bool) or not hasattr(value, "__index__") else " (pass int(...))"
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}{hint}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes: Optional[Sequence[torch.dtype]] = None, ndim: Optional[int] = None,
                 shape: Optional[Tuple[Optional[int], ...]] = None, device: Optional[torch.device] = None,
                 contiguous: bool = True) -> torch.Tensor:
    """Check one tensor argument; `shape` entries that are None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for want, got in zip(shape, t.shape):
            if want is not None and want != got:
                want_s = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {want_s}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def check_row_bytes(name: str, t: torch.Tensor) -> None:
    """Rows move in 16-byte vectors: each row must be a whole number of them."""
    row = t.shape[-1] * t.element_size()
    if row % 16:
        raise ValueError(f"{name}: a row is {row} bytes ({t.shape[-1]} x {t.element_size()}); it must be a multiple "
                         f"of 16 (hidden size divisible by {16 // t.element_size()} for "
                         f"{str(t.dtype).replace('torch.', '')})")


def check_num_experts(num_experts: int, num_ranks: int) -> None:
    check_count("num_experts", num_experts)
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the group size ({num_ranks})")


def check_topk_idx(topk_idx, num_experts: int, *, num_tokens: Optional[int] = None,
                   device: Optional[torch.device] = None, values: bool = True, distinct: bool = False) -> torch.Tensor:
    """topk_idx: int64 [T, K] with ids in [-1, num_experts); optionally no expert twice in one token."""
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), shape=(num_tokens, None), device=device)
    k = topk_idx.shape[1]
    if not 0 < k <= MAX_TOPK:
        raise ValueError(f"topk_idx has {k} slots per token; 1..{MAX_TOPK} are supported")
    if values and topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise ValueError(f"topk_idx holds expert id {bad}; ids must be -1 (unused slot) or in [0, {num_experts})")
        if distinct and k > 1:
            s = topk_idx.sort(dim=1).values
            if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
                raise ValueError("topk_idx names the same expert twice in one token; a token goes to each of its "
                                 "experts once (a repeated id would count it twice)")
    return topk_idx


def check_topk_weights(topk_weights, topk_idx: torch.Tensor) -> torch.Tensor:
    return check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=tuple(topk_idx.shape),
                        device=topk_idx.device)


def check_combine_weights(topk_weights, rows: int, device: torch.device) -> None:
    """combine's topk_weights: None, or float32 [rows, K] with K <= MAX_TOPK."""
    if topk_weights is None:
        return
    check_tensor("topk_weights", topk_weights, dtypes=(torch.float32,), shape=(rows, None), device=device)
    if topk_weights.shape[1] > MAX_TOPK:
        raise ValueError(f"combine: topk_weights has {topk_weights.shape[1]} columns; at most {MAX_TOPK} top-k "
                         f"weights per row")


def split_x(x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Normal-dispatch input: a float tensor [T, H], or (fp8 e4m3 [T, H], scales float32/int32 [T, S])."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise TypeError(f"x as a tuple must be (fp8 data, scales), got {len(x)} elements")
        data, scales = x
        check_tensor("x[0] (FP8 data)", data, dtypes=FP8_DTYPES, ndim=2)
        check_tensor("x[1] (FP8 scales)", scales, dtypes=SCALE_DTYPES, shape=(data.shape[0], None), device=data.device,
                     contiguous=False)
        check_row_bytes("x[0] (FP8 data)", data)
        return data, scales.contiguous()  # column-major scales (as grouped GEMMs emit them) are accepted
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_row_bytes("x", x)
    return x, None


def normalise_bias(bias, num_tokens: int, hidden: int, dtype: torch.dtype,
                   device: torch.device) -> Tuple[torch.Tensor, ...]:
    """None, a tensor, or a tuple/list of at most two tensors [T, H] -> a tuple."""
    if bias is None:
        return ()
    items = tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if len(items) > 2:
        raise ValueError(f"bias takes at most 2 tensors, got {len(items)}")
    out = []
    for i, b in enumerate(items):
        if b is None:
            continue
        out.append(check_tensor(f"bias[{i}]", b, dtypes=(dtype,), shape=(num_tokens, hidden), device=device))
    return tuple(out)


def check_flag_exclusive(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook are exclusive: with a hook, receiving is the hook's job")
