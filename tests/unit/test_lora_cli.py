"""ext/lora's flags on the command line (the `scheduler_options` point): vLLM's names and
SGLang's --lora-paths, parsed into SchedulerConfig.extras["lora"]; bad combinations exit 2
naming the flag; the adapters the API server serves (`served_adapters`) and their cards; the
start's check of the adapters (--max-lora-rank); the prefix cache's key per adapter."""

from __future__ import annotations

import pytest

from minisgl.core import Req, SamplingParams
from minisgl.ext.lora import served_adapters
from minisgl.ext.lora.options import LoraOptions, lora_options
from minisgl.extension import StepFeature
from minisgl.scheduler.planner import BatchPlanner
from minisgl.server.args import parse_args
from minisgl.utils.options import OptionError
from support.lora import save_adapter


def test_flags_parse_into_the_scheduler_config():
    argv = ["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    argv += ["--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16"]
    args = parse_args(argv + ["--served-model-name", "base"])
    options = lora_options(args.scheduler)
    assert (options.max_loras, options.cpu_loras, options.max_lora_rank) == (2, 3, 16)
    assert [m.name for m in options.modules()] == ["a", "b"]
    assert served_adapters(args) == {
        "a": {"root": "/x", "parent": "base"},
        "b": {"root": "/y", "parent": "base"},
    }
    alias = parse_args(["--enable-lora", "--lora-paths", "c=/z"])  # SGLang's name
    assert [m.name for m in lora_options(alias.scheduler).modules()] == ["c"]
    assert served_adapters(parse_args([])) == {}  # off: no adapter is served


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lora-modules", "a=/x"], "--lora-modules"),  # without --enable-lora
        (["--enable-lora", "--lora-modules", "noequals"], "--lora-modules"),
        (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "--max-cpu-loras"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_start_checks_the_rank_and_the_path(tmp_path):
    save_adapter("llama", str(tmp_path / "a"), seed=1, r=8)
    options = LoraOptions(True, (f"a={tmp_path / 'a'}",), max_lora_rank=8)
    assert lora_options_path(options.resolve_models()) == str(tmp_path / "a")
    with pytest.raises(OptionError, match="rank 8 is over max_lora_rank 4") as e:
        LoraOptions(True, (f"a={tmp_path / 'a'}",), max_lora_rank=4).resolve_models()
    assert e.value.name == "max_lora_rank"
    (tmp_path / "file").write_text("")
    with pytest.raises(OptionError, match="is a file") as e:
        LoraOptions(True, (f"b={tmp_path / 'file'}",)).resolve_models()
    assert e.value.name == "lora_modules"


def lora_options_path(options: LoraOptions) -> str:
    (module,) = options.modules()
    return module.path


class _Space(StepFeature):
    name = "space"

    def cache_namespace(self, req: Req) -> int:
        return req.ext[self.name]


def test_cache_key_salts_the_first_token_by_namespace():
    """Requests of two namespaces key the same tokens apart (a negative first id no token
    has); namespace 0 and requests without the feature key them as they are."""
    planner = BatchPlanner.__new__(BatchPlanner)  # only `features` is read
    planner.features = [_Space()]
    reqs = [Req([7, 1, 2, 3], 4, SamplingParams(), 8) for _ in range(4)]
    for req, space in zip(reqs[1:], [1, 2, 0]):
        req.ext["space"] = space
    keys = [planner._cache_key(r, 3) for r in reqs]
    assert keys[0] == keys[3] == [7, 1, 2]
    assert keys[1][1:] == keys[2][1:] == [1, 2] and keys[1][0] != keys[2][0]
    assert keys[1][0] < 0 and keys[2][0] < 0 and reqs[1].tokens == [7, 1, 2, 3]
