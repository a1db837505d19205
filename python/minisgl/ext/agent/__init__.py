"""Agent APIs: the protocols agent frameworks speak, each one conversion layer over the core's
chat path (templates, parsers, grammars, sampling), never a second pipeline.

Importing this package adds their routes through the `routes` point of
`minisgl.extension.Extensions`; without it those paths answer 404."""

from __future__ import annotations

from minisgl.ext.agent import messages, responses
from minisgl.extension import extensions

_points = extensions()
# -- routes: one line per API --
_points.routes.append(responses.add_routes)  # /v1/responses (OpenAI Responses API)
_points.routes.append(messages.add_routes)  # /v1/messages (Anthropic Messages API)
