"""Benchmark CLI: `python -m moe_dispatcher.bench --help`; bench/README.md explains the columns.

Modules: cli (options, the per-rank driver), launch (self-spawning ranks or torchrun), timing (CUDA events,
host overhead, cross-rank statistics), normal / low_latency (the cases and their NCCL baselines), report
(tables, JSON, PNG).
"""
from .cli import main

__all__ = ["main"]
