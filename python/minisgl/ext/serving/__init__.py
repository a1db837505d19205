"""Serving operations beyond the core's API server:

- `sglang.py`: SGLang's native endpoints that sglang-router and SGLang's tools call on a worker
  (/model_info, /server_info, /get_load, /flush_cache) and SGLang's extra
  /generate fields at their defaults; `flush.py`: /flush_cache's messages and its handling in
  the scheduler process (the `scheduler_messages` point);
- `model_card.py`: /v1/models with the tokenizer's `vocab_size` (benchmarks read it);
- `metrics.py`: Prometheus metrics (`GET /metrics`), counted as the API process sees its
  requests (its Frontend's `metrics`) and read from the schedulers' snapshots;
- `dispatch.py`, `worker.py`: which --dp replica a request goes to (longest prefix), chosen by
  its tokenizer worker (the `launcher` point's), which also bounds and backgrounds long prompts;
- `replicas.py`, `llm_dp.py`: `LLM(dp=N)`, one process per replica (the `replicas` point);
- `policy.py`: --schedule-policy priority (the request's `priority`, aged, preempting) and lpm
  (the `admission_policies` and `sampling_params` points);
- `tokenizer_info.py`: vLLM's /tokenizer_info (lm-eval's remote tokenizer reads it);
  `tokenize.py`: vLLM's /tokenize and /detokenize; `api_tokenizer.py`: the API process's
  tokenizer, loaded on first use (for these and the other extensions' HTTP work);
- `fields.py`: a request's fields no one declares (OpenAI's of no effect or unsupported, vLLM's
  warning about the others; the `unknown_fields` point), its `priority` and SGLang's
  `data_parallel_rank` (`request_fields`) and the bounds on its stop strings and messages
  (`request_checks`);
- `status.py`: /health with SGLang's `generate` (and /health_generate), /stats of every API
  process (ahead of the core's); `openapi.py`: the error statuses in the OpenAPI document;
- `disconnect.py`: a plain (not streamed) response cancelled when its client leaves;
- `options.py`: its flags (the `options` point), e.g. --max-connections; `template.py`:
  --chat-template (vLLM's), applied by its tokenizer workers;
- `http.py`, `connections.py`: the limits on requests in progress and on connections, the body
  read timeout and size (--max-request-bytes), every response counted, and a drain that ends
  its requests with an error (the `gate` and `http_server` points); `auth.py`: --api-key;
  `frontend.py`: --max-queued-requests and --request-timeout (the `launcher` point's Frontend);
- `warmup.py`: the start-up warm-up where kernels compile (the `warm_up` point);
- `scale.py`: --dp's replicas, --api-server-count's API processes and --nnodes' nodes (the
  `launcher` point), whose pipeline routes each reply to its API process (`apis.py`);
  `collector.py`: the garbage collector of every server process, frozen once
  ready, and its flags (the `process_ready` point); `parent.py`: --exit-with-parent.

Importing this package fills its points of `minisgl.extension.Extensions`; without it those
routes answer 404, /health?generate=1 is a 400, every API path refuses the fields it does not
declare, and --dp > 1, `LLM(dp=N > 1)`, a request's `priority` or `data_parallel_rank` and
--schedule-policy priority / lpm are refused, and so are --api-key, MINISGL_API_KEY,
--exit-with-parent, --chat-template and --skip-server-warmup; /v1/models has no vocab_size."""

from __future__ import annotations

from minisgl.ext.lazy import Lazy
from minisgl.ext.serving import collector, fields, flush, http, options, policy, sglang, warmup
from minisgl.extension import extensions

# The API process's parts (fastapi, prometheus_client, the launcher) and `LLM(dp=N)`'s are
# imported when called (`Lazy`): the tokenizer workers, the detokenizer and the schedulers load
# this registry without them (issue 47).
_SERVING = "minisgl.ext.serving"
_points = extensions()
_points.routes += [
    sglang.add_sglang_routes,
    Lazy(f"{_SERVING}.metrics", "add_metrics_route"),
    Lazy(f"{_SERVING}.openapi", "add_openapi_errors"),
]
_points.routes.append(Lazy(f"{_SERVING}.status", "add_status_routes"))
_points.routes.append(Lazy(f"{_SERVING}.disconnect", "add_disconnect_routes"))
_points.routes.append(Lazy(f"{_SERVING}.tokenizer_info", "add_tokenizer_info_route"))
_points.routes.append(Lazy(f"{_SERVING}.tokenize", "add_tokenize_routes"))
_points.routes.append(Lazy(f"{_SERVING}.model_card", "add_models_route"))
_points.unknown_fields = fields.UnknownFields()
_points.request_checks.append(fields.check_limits)
for _path in ("/v1/chat/completions", "/v1/completions", "/generate"):
    _points.request_fields.setdefault(_path, []).append(fields.PriorityFields)
_points.request_fields["/generate"] += [sglang.MetaInfoFields, fields.DataParallelFields]
_points.replicas = Lazy(f"{_SERVING}.replicas", "replicated_llm")
_points.options["serving"] = options.ServingOptions
_points.gate = http.ServingGate
_points.http_server = http.serving_http_server
_points.launcher = Lazy(f"{_SERVING}.scale", "ServingLauncher")
_points.scheduler_options["serving"] = policy.PolicyOptions  # --priority-aging
_points.admission_policies.update(priority=policy.PriorityQueue, lpm=policy.LongestPrefixQueue)
_points.sampling_params["priority"] = policy.check_priority
_points.process_ready = collector.on_ready
_points.warm_up = warmup.warm_up_when_needed
_points.scheduler_messages[flush.FlushCacheRequest] = flush.handle_flush
