"""Structured output's chat side: tool calling and reasoning. The parsers (`parsers/`, one
module per format under vLLM's name) split a response into content, reasoning_content and
tool_calls; `server.py` validates a request's tools and shapes the API server's messages and
stream deltas; `offline.py` does the same for `LLM.chat`, `shell.py` for the shell's display.
Registered as the `chat_features` point, its flags (--tool-call-parser, --reasoning-parser,
--shell-hide-reasoning) as the `options` point's `ChatOptions`: without this package the core
refuses tools and those flags. Constrained decoding (xgrammar: json_schema, regex,
ebnf, structural_tag; `grammar.py`, `grammar_feature.py`) is the `step_features` point's
`GrammarFeature`, its fields checked through `sampling_params`, its flags `options.py`'s
(`scheduler_options`)."""

from minisgl.core import CONSTRAINT_KINDS
from minisgl.ext.structured import fields
from minisgl.ext.structured.features import StructuredChat
from minisgl.ext.structured.grammar_feature import GrammarFeature, check_constraint
from minisgl.ext.structured.options import ChatOptions, StructuredOptions
from minisgl.extension import extensions

extensions().chat_features = StructuredChat()
extensions().sampling_params.update(dict.fromkeys(CONSTRAINT_KINDS, check_constraint))
extensions().step_features.append(GrammarFeature)
extensions().request_checks.append(fields.check_grammar_size)
for _path, _models in fields.FIELDS.items():
    extensions().request_fields.setdefault(_path, []).extend(_models)
extensions().scheduler_options["structured"] = StructuredOptions
extensions().options["structured"] = ChatOptions  # --tool-call-parser, --reasoning-parser
