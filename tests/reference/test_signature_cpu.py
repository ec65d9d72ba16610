"""moe_dispatcher.signature on its own (no ranks): the error text names the field, the values and the ranks;
the hash the compiled notify carries ignores the problem word and changes with any field."""
from __future__ import annotations

import pytest
import torch

from moe_dispatcher import Config
from moe_dispatcher.signature import (SIGNATURE_WORDS, Signature, SignatureMismatch, check_agreement,
                                      disagreement, dispatch_signature, signature_hash)


def _dispatch(hidden=128, dtype=torch.bfloat16, k=2, weights=True, experts=8, problem=0) -> Signature:
    x = torch.zeros(4, hidden, dtype=dtype)
    idx = torch.zeros(4, k, dtype=torch.int64)
    return dispatch_signature("dispatch", x, None, idx, torch.zeros(4, k) if weights else None, experts, Config(),
                              problem)


def _table(*signatures: Signature) -> torch.Tensor:
    return torch.stack([s.tensor() for s in signatures])


def test_equal_signatures_agree() -> None:
    assert _dispatch().tensor().shape == (SIGNATURE_WORDS,)
    assert disagreement(_table(_dispatch(), _dispatch(), _dispatch())) == ""
    check_agreement(_table(_dispatch(), _dispatch()))


def test_the_text_names_field_values_and_ranks() -> None:
    text = disagreement(_table(_dispatch(), _dispatch(), _dispatch(), _dispatch(hidden=256, dtype=torch.float16)))
    assert text.startswith("dispatch: the ranks' calls do not agree: "), text
    assert "hidden differs: 128 on ranks 0, 1, 2; 256 on rank 3" in text, text
    assert "x dtype differs: bfloat16 on ranks 0, 1, 2; float16 on rank 3" in text, text
    text = disagreement(_table(_dispatch(weights=False), _dispatch()))
    assert "topk_weights given differs: no on rank 0; yes on rank 1" in text, text
    with pytest.raises(SignatureMismatch, match="top-k differs: 2 on rank 0; 3 on rank 1") as info:
        check_agreement(_table(_dispatch(), _dispatch(k=3)))
    assert isinstance(info.value, ValueError) and info.value.raised_on_every_rank


def test_a_problem_of_one_rank_and_different_calls() -> None:
    text = disagreement(_table(_dispatch(), _dispatch(problem=2)))
    assert "on rank 1, the layout" in text and "differs" not in text, text
    combine = Signature("combine", (1, 128, torch.bfloat16, 0, 20, 6, 256, 6, 256))
    assert disagreement(_table(_dispatch(), combine, _dispatch())) == (
        "the ranks are in different calls: dispatch on ranks 0, 2; combine on rank 1")


def test_hash_ignores_the_problem_word_only() -> None:
    base = signature_hash(_dispatch())
    assert -(1 << 31) <= base < (1 << 31)
    assert signature_hash(_dispatch(problem=3)) == base
    for other in (_dispatch(hidden=256), _dispatch(dtype=torch.float16), _dispatch(k=3), _dispatch(weights=False),
                  _dispatch(experts=16)):
        assert signature_hash(other) != base


def test_hash_is_the_same_in_every_process() -> None:
    """Ranks are separate processes: the hash must not depend on Python's per-process string salt."""
    import os
    import subprocess
    import sys
    code = ("import torch; from moe_dispatcher import Config; "
            "from moe_dispatcher.signature import dispatch_signature, signature_hash; "
            "x = torch.zeros(4, 128, dtype=torch.bfloat16); i = torch.zeros(4, 2, dtype=torch.int64); "
            "print(signature_hash(dispatch_signature('dispatch', x, None, i, None, 8, Config())))")
    seen = {subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed), check=True,
                           capture_output=True, text=True).stdout.strip() for seed in ("0", "1", "random")}
    assert len(seen) == 1, seen
