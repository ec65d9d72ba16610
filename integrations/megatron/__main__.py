"""Run a Megatron-LM script with moe_dispatcher registered (so its argparse accepts our dispatcher types) and
each training step's fixed-size expert rows checked at its end (guard_training_steps; bound sizing):

    torchrun --nproc_per_node 8 -m moe_dispatcher.integrations.megatron pretrain_gpt.py \\
        --moe-token-dispatcher-type moe_dispatcher ...
"""
import os
import runpy
import sys

from moe_dispatcher.integrations.megatron import guard_training_steps  # (importing registers)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    guard_training_steps()  # before the script imports megatron.training, which binds the function
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script.py` would
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
