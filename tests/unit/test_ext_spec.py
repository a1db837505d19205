"""The spec (speculative decoding) and perf (prompts as CUDA-graph rows) extensions as the core
sees them (issue 46): with them their options are flags and `LLM(...)` keywords, parsed into
`SchedulerConfig.extras`, and they fill the `step_features` (the speculation) and
`forward_paths` points; the core alone refuses those options naming the flag and the extension.
Their behaviour: tests/engine/test_spec.py, tests/engine/test_prefill_rows.py."""

from __future__ import annotations

import pytest

from minisgl import LLM, extension
from minisgl.extension import ExtensionMissing
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import parse_args

REFUSED = [
    ("speculative_algorithm", "ngram", "spec"),
    ("speculative_num_draft_tokens", 3, "spec"),
    ("disable_prefill_graphs", True, "perf"),
]


def test_the_extensions_fill_their_points() -> None:
    points = extension.extensions()
    assert {"spec", "perf"} <= set(points.scheduler_options)
    from minisgl.ext.spec.speculator import make_speculation

    makers = [getattr(m, "resolve", lambda m=m: m)() for m in points.step_features]
    assert make_speculation in makers and len(points.forward_paths) >= 2
    config = parse_args(["--speculative-algorithm", "ngram", "--disable-prefill-graphs"])
    spec, perf = config.scheduler.extras["spec"], config.scheduler.extras["perf"]
    assert spec.speculative_algorithm == "ngram" and perf.disable_prefill_graphs
    assert SchedulerConfig().extras["spec"].speculative_algorithm is None  # off by default


@pytest.mark.core
@pytest.mark.parametrize(("name", "value", "ext"), REFUSED)
def test_options_need_their_extension(
    core_alone: None, tmp_path, name: str, value: object, ext: str
) -> None:
    needs = f"needs the {ext} extension (minisgl/ext/{ext})"
    with pytest.raises(ExtensionMissing) as info:
        LLM(str(tmp_path), **{name: value})  # refused before any model is read
    assert isinstance(info.value, ValueError) and str(info.value) == f"{name} {needs}"
    with pytest.raises(TypeError, match="unknown option"):
        SchedulerConfig.from_options({"no_such_option": 1})


@pytest.mark.core
@pytest.mark.parametrize(("name", "value", "ext"), REFUSED)
def test_flags_need_their_extension(
    core_alone: None, capsys, name: str, value: object, ext: str
) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SystemExit) as done:
        parse_args([flag] if value is True else [flag, str(value)])
    assert done.value.code == 2
    needs = f"error: {flag} needs the {ext} extension (minisgl/ext/{ext})"
    assert needs in capsys.readouterr().err
