"""Agent APIs: the protocols agent frameworks speak, each one conversion layer over the core's
chat path (templates, parsers, grammars, sampling), never a second pipeline.

Importing this package adds their routes through the `routes` point of
`minisgl.extension.Extensions`; without it those paths answer 404. The modules (fastapi) are
imported when the API process adds the routes (`Lazy`): every other process loads this registry
without them (issue 47)."""

from __future__ import annotations

from minisgl.ext.lazy import Lazy
from minisgl.extension import extensions

_points = extensions()
# -- routes: one line per API --
_points.routes.append(Lazy("minisgl.ext.agent.responses", "add_routes"))  # /v1/responses (OpenAI)
_points.routes.append(Lazy("minisgl.ext.agent.messages", "add_routes"))  # /v1/messages (Anthropic)
