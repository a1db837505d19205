from dataclasses import fields

import pytest

from minisgl.engine.config import EngineConfig
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, build_parser, parse_args


def test_defaults():
    args = parse_args([])
    assert args == ServerArgs()
    engine, sched = args.engine, args.scheduler
    assert engine.model is None
    assert (engine.device, engine.dtype, args.tp) == ("auto", "auto", 1)
    assert (args.host, args.port) == ("127.0.0.1", 1919)
    assert (engine.page_size, engine.max_running_requests) == (16, 256)
    # budgets: None until the scheduler has its engine (8192, or an extension's for it)
    assert (sched.max_prefill_tokens, sched.max_num_batched_tokens) == (None, None)
    assert (sched.cache, engine.attn, engine.attn_backends) == ("radix", "auto", ("auto", "auto"))
    assert (engine.cuda_graph_max_bs, engine.memory_ratio) == (256, 0.9)
    assert (engine.num_pages, engine.max_model_len, args.num_tokenizer) == (None, None, 1)
    assert (engine.dummy_weights, args.shell) == (False, False)
    assert (engine.seed, args.log_level) == (0, "info")
    serving = args.extras["serving"]  # the request limits and the API key: the serving extension's
    assert serving.api_key is None
    assert (serving.max_queued_requests, serving.request_timeout) == (None, None)
    assert (serving.max_request_bytes, args.shutdown_timeout) == (16 * 2**20, 30.0)


def test_parser_defaults_match_dataclass():
    # One source of truth: every option field is a flag, its default the dataclass default.
    parsed = vars(build_parser().parse_args([]))
    options = {}
    extras = list(ServerArgs().extras.values())  # the extensions' option dataclasses
    extras += SchedulerConfig().extras.values()  # and those for the schedulers (spec, perf)
    assert extras  # the serving extension's, at least
    for config in (EngineConfig(), SchedulerConfig(), ServerArgs(), *extras):
        options |= {f.name: getattr(config, f.name) for f in fields(config) if "help" in f.metadata}
    assert parsed == options


def test_old_flag_names_still_work():
    assert parse_args(["--max-prefill-length", "512"]).scheduler.max_prefill_tokens == 512
    assert parse_args(["--max-prefill-tokens", "512"]).scheduler.max_prefill_tokens == 512


def test_all_flags():
    from minisgl.ext.serving.options import ServingOptions

    args = parse_args(
        "--model /m --device cpu --dtype bfloat16 --tp 2 --host 0.0.0.0 --port 8000 "
        "--page-size 1 --max-prefill-length 512 --max-running-requests 8 --cache naive "
        "--attn fi,triton --moe-backend torch --cuda-graph-max-bs 0 --memory-ratio 1 --num-pages 100 "
        "--max-model-len 2048 --num-tokenizer 2 --dummy-weights --shell --api-key sk-1 "
        "--seed 42 --log-level DEBUG --max-queued-requests 64 --request-timeout 2.5 "
        "--max-request-bytes 1000 --shutdown-timeout 0".split()
    )
    engine = EngineConfig(
        model="/m",
        device="cpu",
        dtype="bfloat16",
        page_size=1,
        max_running_requests=8,
        attn="fi,triton",
        moe_backend="torch",
        cuda_graph_max_bs=0,
        memory_ratio=1.0,
        num_pages=100,
        max_model_len=2048,
        dummy_weights=True,
        seed=42,
    )
    assert args == ServerArgs(
        engine,
        SchedulerConfig(max_prefill_tokens=512, cache="naive"),
        tp=2,
        host="0.0.0.0",
        port=8000,
        num_tokenizer=2,
        shell=True,
        log_level="debug",
        shutdown_timeout=0.0,
        extras={
            "serving": ServingOptions(
                api_key="sk-1", max_queued_requests=64, request_timeout=2.5, max_request_bytes=1000
            )
        },
    )
    assert args.engine.attn_backends == ("fi", "triton")


@pytest.mark.parametrize(
    "value, backends",
    [
        ("auto", ("auto", "auto")),
        ("torch", ("torch", "torch")),
        ("FI", ("fi", "fi")),
        ("triton,fi", ("triton", "fi")),
        ("fi, Torch", ("fi", "torch")),
        ("fi,fi", ("fi", "fi")),
    ],
)
def test_attn_values(value, backends):
    assert parse_args(["--attn", value]).engine.attn_backends == backends
    assert EngineConfig(attn=value).attn_backends == backends  # LLM(attn=...) alike


def test_hub_id_model():
    assert parse_args(["--model", "Qwen/Qwen3-0.6B"]).engine.model == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--device", "tpu"),
        ("--dtype", "float64"),
        ("--tp", "0"),
        ("--tp", "two"),
        ("--port", "0"),
        ("--port", "65536"),
        ("--port", "http"),
        ("--page-size", "0"),
        ("--max-prefill-length", "0"),
        ("--max-prefill-tokens", "0"),
        ("--max-running-requests", "-1"),
        ("--cache", "lru"),
        ("--attn", "flash"),
        ("--attn", "fa"),  # flash-attn is not a backend (yet)
        ("--attn", "fi,triton,torch"),
        ("--attn", "fi,"),
        ("--attn", "auto,fi"),
        ("--attn", ""),
        ("--cuda-graph-max-bs", "-1"),
        ("--memory-ratio", "0"),
        ("--memory-ratio", "1.5"),
        ("--memory-ratio", "nan"),
        ("--memory-ratio", "lots"),
        ("--num-pages", "0"),
        ("--max-model-len", "0"),
        ("--max-model-len", "1"),
        ("--cpu-kv-cache-mb", "0"),
        ("--num-tokenizer", "0"),
        ("--seed", "x"),
        ("--log-level", "verbose"),
        ("--max-queued-requests", "0"),
        ("--request-timeout", "0"),
        ("--request-timeout", "-1"),
        ("--request-timeout", "inf"),
        ("--request-timeout", "nan"),
        ("--max-request-bytes", "0"),
        ("--shutdown-timeout", "-1"),
        ("--shutdown-timeout", "soon"),
        ("--dp", "0"),
        ("--dp-dispatch", "random"),
        ("--dp-load-threshold", "-1"),
        ("--nnodes", "0"),
        ("--node-rank", "-1"),
        ("--dist-init-addr", "10.0.0.1"),
        ("--dist-init-addr", "10.0.0.1:0"),
        ("--dist-init-addr", ":29500"),
        ("--dist-timeout", "0"),
    ],
)
def test_invalid_value_exits_2_naming_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1  # exactly one line
    assert f"error: argument {flag}:" in err


def test_range_message(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--port", "0"])
    err = capsys.readouterr().err
    assert err == "python -m minisgl: error: argument --port: must be in 1..65535, got 0\n"


@pytest.mark.parametrize("argv", [["--bogus"], ["--model"], ["--por", "80"], ["extra"]])
def test_unknown_or_malformed_exits_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-prefill-length" in out
    for config in (EngineConfig, SchedulerConfig, ServerArgs):
        for f in fields(config):
            if "help" in f.metadata:
                assert "--" + f.name.replace("_", "-") in out


def test_llm_takes_the_option_names():
    from minisgl import LLM

    with pytest.raises(TypeError, match="unknown option.*max_prefill_length"):
        LLM("unused", page_size=4, max_prefill_length=512)  # the flag's alias is no keyword


@pytest.mark.parametrize(
    "argv, flag, message",
    [
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank", "must be in 0..1"),
        (["--node-rank", "1"], "--node-rank", "must be in 0..0"),
        (["--nnodes", "2", "--tp", "2"], "--dist-init-addr", "is required with --nnodes > 1"),
        (["--nnodes", "2", "--tp", "3", "--dist-init-addr", "h:1"], "--tp", "multiple of"),
        (["--nnodes", "2", "--tp", "2", "--dp", "2", "--dist-init-addr", "h:1"], "--dp", "not"),
    ],
)
def test_scale_out_combinations_exit_2_naming_flag(argv, flag, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err and message in err


def test_scale_out_flags():
    args = parse_args(
        ["--tp", "4", "--nnodes", "2", "--node-rank", "1"]
        + ["--dist-init-addr", "[::1]:29500", "--dist-timeout", "5"]
    )
    from minisgl.ext.serving.options import serving_options
    from minisgl.ext.serving.scale import ServingLauncher

    options = serving_options(args)
    assert (options.nnodes, options.node_rank, options.dist_timeout) == (2, 1, 5.0)
    launcher = ServingLauncher.__new__(ServingLauncher)  # its ranks per node, nothing started
    launcher.args, launcher.options = args, options
    assert launcher.ranks_here == 2
    args = parse_args(["--dp", "4", "--dp-dispatch", "round_robin", "--dp-load-threshold", "0"])
    options = serving_options(args)
    assert (options.dp, options.dp_dispatch, options.dp_load_threshold) == (4, "round_robin", 0)


def test_dp_times_tp_above_the_gpus_fails_naming_both(monkeypatch):
    import torch

    from minisgl.ext.serving.scale import check_scale_out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    args = parse_args(["--dp", "3", "--tp", "2", "--device", "cuda"])
    with pytest.raises(ValueError, match=r"--dp 3 x --tp 2 needs 6 GPUs on this machine, found 4"):
        check_scale_out(args, args.engine)


@pytest.mark.parametrize(
    ("name", "dtype"), [("half", "float16"), ("float", "float32"), ("fp8", "float8_e4m3fn")]
)
def test_vllm_dtype_names(model_dirs, name, dtype):
    """vLLM's --dtype half / float and --kv-cache-dtype fp8 mean what they mean there."""
    import torch

    from minisgl import LLM

    flag = "--kv-cache-dtype" if name == "fp8" else "--dtype"
    engine_args = parse_args(["--model", "m", flag, name]).engine
    assert name in (engine_args.dtype, engine_args.kv_cache_dtype)
    option = {"kv_cache_dtype" if name == "fp8" else "dtype": name}
    llm = LLM(model_dirs("llama")[0], device="cpu", num_pages=16, **option)
    stored = llm.engine.kv_cache.dtype if name == "fp8" else llm.engine.dtype
    assert stored == getattr(torch, dtype)
    llm.shutdown()


@pytest.mark.parametrize(
    ("argv", "where", "name", "value"),
    [
        (["--model-path", "m"], "engine", "model", "m"),  # SGLang's names, then vLLM's
        (["--tp-size", "2"], "server", "tp", 2),
        (["--dp-size", "2"], "serving", "dp", 2),
        (["--context-length", "1024"], "engine", "max_model_len", 1024),
        (["--chunked-prefill-size", "512"], "scheduler", "max_prefill_tokens", 512),
        (["--random-seed", "7"], "engine", "seed", 7),
        (["--disable-cuda-graph"], "engine", "cuda_graph_max_bs", 0),
        (["--disable-radix-cache"], "scheduler", "cache", "naive"),
        (["--tensor-parallel-size", "2"], "server", "tp", 2),
        (["--data-parallel-size", "2"], "serving", "dp", 2),
        (["--max-num-seqs", "8"], "engine", "max_running_requests", 8),
        (["--enforce-eager"], "engine", "cuda_graph_max_bs", 0),
        (["--no-enable-prefix-caching"], "scheduler", "cache", "naive"),
        (["--enable-prefix-caching"], "scheduler", "cache", "radix"),
    ],
)
def test_vllm_and_sglang_flag_names(argv, where, name, value):
    from minisgl.ext.serving.options import ServingOptions, serving_options

    args = parse_args(argv)
    serving = serving_options(args)
    config = {
        "engine": args.engine,
        "scheduler": args.scheduler,
        "server": args,
        "serving": serving,
    }
    assert getattr(config[where], name) == value
    others = {"engine": EngineConfig(), "scheduler": SchedulerConfig(), "server": ServerArgs()}
    others["serving"] = ServingOptions()
    assert getattr(others[where], name) != value or argv == ["--enable-prefix-caching"]


def test_an_alias_s_error_names_the_alias(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--tp-size", "0"])
    assert "error: argument --tp-size: must be >= 1, got 0" in capsys.readouterr().err


def test_help_is_grouped_with_aliases_in_their_flag_s_entry(capsys):
    from minisgl.server.args import _GROUP_OF, HELP_GROUPS

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    lines = capsys.readouterr().out.splitlines()
    titles = [line for line in lines if line[:1].isalpha()]
    # the extensions' own groups (one each, whichever kinds of options it has)
    names = list(dict.fromkeys([*SchedulerConfig().extras, *ServerArgs().extras]))
    extensions = [f"{name} extension:" for name in names]  # after the core's
    assert (
        titles[-len(HELP_GROUPS) - len(extensions) :]
        == [f"{title}:" for title in HELP_GROUPS] + extensions
    )
    entries = [line.split()[0].rstrip(",") for line in lines if line.startswith("  --")]
    aliases = {
        alias
        for config in (EngineConfig, SchedulerConfig, ServerArgs)
        for f in fields(config)
        for alias in f.metadata.get("aliases", [])
    }
    assert aliases and not aliases & set(entries)  # each only beside its flag
    assert "  --tp, --tensor-parallel-size, --tp-size TP" in lines
    names = {f.name for c in (EngineConfig, SchedulerConfig, ServerArgs) for f in fields(c)}
    assert {n for group in _GROUP_OF.values() for n in group} <= names  # no stale name
