"""Serving operations beyond the core's API server:

- `sglang.py`: SGLang's native endpoints that sglang-router and SGLang's tools call on a worker
  (/model_info, /server_info, /get_load, /flush_cache, /health_generate) and SGLang's extra
  /generate fields at their defaults;
- `metrics.py`: Prometheus metrics (`GET /metrics`), counted as the API process sees its
  requests (the `request_observer` point) and read from the schedulers' snapshots.

Importing this package fills its points of `minisgl.extension.Extensions`; without it those
routes answer 404 and /generate refuses every field it does not declare."""

from __future__ import annotations

from minisgl.ext.serving import metrics, sglang
from minisgl.extension import extensions

_points = extensions()
_points.routes += [sglang.add_sglang_routes, metrics.add_metrics_route]
_points.generate_extras = sglang.check_generate_extras
_points.request_observer = metrics.frontend_metrics
