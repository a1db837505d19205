"""Speed paths that have a plain equivalent in the core: `prefill_rows.py` replays a small
prefill or mixed step in the decode CUDA graphs, one row per position, instead of the eager
step (the `forward_paths` point, with the prompt budget that makes steps fit it), switched off
by --disable-prefill-graphs (`options.py`, the `scheduler_options` point); `hybrid.py` runs
`--attn PREFILL,DECODE` (the `hybrid_attention` point; fi's prefill gathers the prompts' K/V
for FlashInfer's ragged kernel, `ragged.py`) and picks --attn auto's prefill on Hopper
(`auto_prefill`); `tables.py` sends a step's page- and token-table writes in one copy
at its head (the `table_writes` point); `chunks.py` writes a stream's chunk of a choice no
extension shapes as one format (the `stream_chunks` point); `offline.py` gives `LLM` 32k-token
prompt chunks on a GPU of >= 70 GiB (the `llm_defaults` point) and no automatic garbage
collection while it steps (the `offline_run` point); `budgets.py` gives a model under a billion
parameters 16k-token steps there, whose 8192-token ones the host cannot launch as fast as the
GPU runs them (the `scheduler_config` point); `transformers_index.py` keeps on disk the
index of its modules that transformers builds at each import (the `before_transformers` point:
~0.6 s of CPU in each server process's start). Without this package every prefill runs
eagerly, each table write is a copy of its own, each chunk is a dict encoded, `LLM` and the
server keep 8192-token chunks, `LLM` the collector, transformers indexes itself at each import,
--attn auto's prefill stays Triton's, and the flag and a backend pair are refused naming it.
The engine's parts (torch) are imported when the engine makes them (`Lazy`): the processes
without an engine load this registry without torch."""

from minisgl.ext.lazy import Lazy
from minisgl.ext.perf import transformers_index
from minisgl.ext.perf.options import PerfOptions
from minisgl.extension import extensions

_points = extensions()
_points.scheduler_options["perf"] = PerfOptions
_points.forward_paths.append(Lazy("minisgl.ext.perf.prefill_rows", "make_prefill_rows"))
_points.table_writes = Lazy("minisgl.ext.perf.tables", "QueuedTableWrites")
_points.hybrid_attention = Lazy("minisgl.ext.perf.hybrid", "HybridAttnBackend")
_points.auto_prefill = Lazy("minisgl.ext.perf.hybrid", "hopper_prefill")
_points.stream_chunks = Lazy("minisgl.ext.perf.chunks", "PlainChunks")
_points.scheduler_config.append(Lazy("minisgl.ext.perf.budgets", "small_model_budgets"))
_points.llm_defaults = Lazy("minisgl.ext.perf.offline", "offline_defaults")
_points.offline_run = Lazy("minisgl.ext.perf.offline", "no_collection")
_points.before_transformers = transformers_index.install
