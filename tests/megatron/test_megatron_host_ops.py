"""Host work of one MoE layer's dispatcher on the compiled path, counted on CPU by tools/megatron_host_ops.py (the
real Buffer and IntranodeBackend over the stub extension; forward and the exchanges' backward).

Host syncs are pinned to what they are: one per layer, the exact sizing's wait for the exchanged counts in
token_dispatch (integrations/megatron/sizing.py). Torch ops per dispatcher step are pinned to at most what they
are (each costs ~5-10 us of host time on the GPU hosts, where training steps are host-bound). A sync or an op
added to a step fails here; a change that removes some should lower the numbers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (bash tools/install_megatron.sh)")

_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                     "megatron_host_ops.py")

SYNCS = {"token_dispatch": 1}
# Without a peer pool / with one (direct dispatch into pool blocks, combine inputs in the pool).
MAX_OPS = {
    "compiled": {"dispatch_preprocess": 8, "token_dispatch": 21, "dispatch_postprocess": 0, "combine_preprocess": 0,
                 "token_combine": 2, "combine_postprocess": 1, "token_combine.backward": 2,
                 "token_dispatch.backward": 4, "backward other": 14},
    "compiled-pool": {"dispatch_preprocess": 8, "token_dispatch": 25, "dispatch_postprocess": 0,
                      "combine_preprocess": 0, "token_combine": 6, "combine_postprocess": 1,
                      "token_combine.backward": 2, "token_dispatch.backward": 12, "backward other": 14},
}


@pytest.mark.parametrize("path", sorted(MAX_OPS))
def test_layer_host_syncs_and_ops(tmp_path, path):
    out = tmp_path / "counts.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_DISPATCHER_")}  # default sizing, no pool env
    proc = subprocess.run([sys.executable, _TOOL, "--path", path, "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = json.loads(out.read_text())
    assert set(counts) == set(MAX_OPS[path]), sorted(counts)
    syncs = {phase: c["syncs"] for phase, c in counts.items() if c["syncs"]}
    assert syncs == SYNCS, f"host syncs per layer changed: {syncs} (expected {SYNCS})\n{proc.stdout}"
    over = {phase: (c["ops"], MAX_OPS[path][phase]) for phase, c in counts.items() if c["ops"] > MAX_OPS[path][phase]}
    assert not over, f"torch ops per layer above the pinned number (got, pinned): {over}\n{proc.stdout}"
