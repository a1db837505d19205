"""A scheduler's step budgets for its engine (the `scheduler_config` point): a model under a
billion parameters on a GPU of >= 70 GiB gets 16,384-token steps rather than 8192, where the
budgets are not given. Such a model's 8192-token step is bound by the host, not the GPU: on an
H200, Qwen3-0.6B's mixed steps of 8192 prompt tokens took the scheduler 21-25 ms to launch
(~420 kernels, eagerly) while the GPU was busy 17.7 ms of each. A burst of 200 requests
(512 -> 256, all at once) then gave 27,311-30,835 out tok/s with ITL p99 23-43 ms; with 16,384
30,813-32,628 tok/s with ITL p99 9.5-21 ms (half as many mixed steps, each a decode stall;
docs/benchmarks.md). A larger model's 8192-token step already keeps the GPU busy longer than
the host takes, and doubling it would double the stall of the running streams."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from minisgl.distributed import all_reduce_min
from minisgl.ext.perf import offline

SMALL_MODEL_PARAMS = 10**9
SMALL_MODEL_STEP_TOKENS = 16384


def small_model_budgets(engine: Any, config: Any) -> Any:
    """`config` with 16,384-token budgets where not given, for a model of fewer than a billion
    parameters (this rank's: its share of each step's work) when every TP rank's GPU is big;
    else `config` as it is."""
    unset = [name for name in offline.CHUNK_OPTIONS if getattr(config, name) is None]
    if not unset:
        return config
    # each rank plans its own steps (ranks > 0 replay rank 0's requests): the budgets must agree
    # where the ranks' GPUs differ (nodes of --nnodes)
    big = all_reduce_min(int(offline.big_gpu(str(engine.device))))
    small = sum(p.numel() for p in engine.model.parameters()) < SMALL_MODEL_PARAMS
    if not (big and small):
        return config
    return replace(config, **dict.fromkeys(unset, SMALL_MODEL_STEP_TOKENS))
