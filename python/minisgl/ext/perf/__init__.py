"""Speed paths that have a plain equivalent in the core: `prefill_rows.py` replays a small
prefill or mixed step in the decode CUDA graphs, one row per position, instead of the eager
step (the `forward_paths` point, with the prompt budget that makes steps fit it), switched off
by --disable-prefill-graphs (`options.py`, the `scheduler_options` point); `hybrid.py` runs
`--attn PREFILL,DECODE` (the `hybrid_attention` point); `tables.py` sends a step's page- and
token-table writes in one copy at its head (the `table_writes` point). Without this package
every prefill runs eagerly, each table write is a copy of its own, and the flag and a backend
pair are refused naming it."""

from minisgl.ext.perf.hybrid import HybridAttnBackend
from minisgl.ext.perf.options import PerfOptions
from minisgl.ext.perf.prefill_rows import make_prefill_rows
from minisgl.ext.perf.tables import QueuedTableWrites
from minisgl.extension import extensions

_points = extensions()
_points.scheduler_options["perf"] = PerfOptions
_points.forward_paths.append(make_prefill_rows)
_points.table_writes = QueuedTableWrites
_points.hybrid_attention = HybridAttnBackend
