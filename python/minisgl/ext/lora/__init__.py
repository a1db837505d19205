"""Multi-LoRA serving (issue 48), in progress: the parts that need nothing of the core beyond a
model transform and per-token adapter slot indices. Not wired into the engine, the server or
`LLM` yet, so this package fills no extension point.

- `adapter.py`: PEFT adapters read from a directory or a hub id, checked against the model,
  mapped onto minisgl's merged projections;
- `weights.py`: the adapters' stacked weights in device slots (sharded like each layer), and
  the slots' manager (LRU eviction of idle adapters to a bounded host cache, pins);
- `layers.py`: the LoRA computation of a projection (torch reference; the kernel's entry
  point) and the model transform that installs it, with its contract with the core;
- `kernel.py`: the Triton kernel (shrink / expand over token tiles per slot) for CUDA;
- `manager.py`: the served adapters by name; `options.py`: the flags, as vLLM's."""
