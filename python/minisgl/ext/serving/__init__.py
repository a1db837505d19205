"""Serving operations beyond the core's API server:

- `sglang.py`: SGLang's native endpoints that sglang-router and SGLang's tools call on a worker
  (/model_info, /server_info, /get_load, /flush_cache, /health_generate) and SGLang's extra
  /generate fields at their defaults;
- `metrics.py`: Prometheus metrics (`GET /metrics`), counted as the API process sees its
  requests (the `request_observer` point) and read from the schedulers' snapshots;
- `dispatch.py`: which --dp replica a request goes to (the `dispatcher` point: longest prefix);
- `replicas.py`: `LLM(dp=N)`, one process per replica (the `replicas` point).

Importing this package fills its points of `minisgl.extension.Extensions`; without it those
routes answer 404, /generate refuses every field it does not declare, and --dp > 1 and
`LLM(dp=N > 1)` are refused."""

from __future__ import annotations

from minisgl.ext.serving import dispatch, metrics, replicas, sglang
from minisgl.extension import extensions

_points = extensions()
_points.routes += [sglang.add_sglang_routes, metrics.add_metrics_route]
_points.generate_extras = sglang.check_generate_extras
_points.request_observer = metrics.frontend_metrics
_points.dispatcher = dispatch.Dispatcher
_points.replicas = replicas.Replicas
