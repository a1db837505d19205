import pytest

from minisgl.server.args import ServerArgs, build_parser, parse_args


def test_defaults():
    args = parse_args([])
    assert args == ServerArgs()
    assert args.model is None
    assert (args.device, args.dtype, args.tp) == ("auto", "auto", 1)
    assert (args.host, args.port) == ("127.0.0.1", 1919)
    assert (args.page_size, args.max_prefill_length, args.max_running_requests) == (16, 8192, 256)
    assert (args.cache, args.attn, args.attn_backends) == ("radix", "auto", ("auto", "auto"))
    assert (args.cuda_graph_max_bs, args.memory_ratio) == (256, 0.9)
    assert (args.num_pages, args.max_model_len, args.num_tokenizer) == (None, None, 1)
    assert (args.dummy_weights, args.shell, args.api_key) == (False, False, None)
    assert (args.seed, args.log_level) == (0, "info")
    assert (args.max_queued_requests, args.request_timeout) == (None, None)
    assert (args.max_request_bytes, args.shutdown_timeout) == (16 * 2**20, 30.0)


def test_parser_defaults_match_dataclass():
    # One source of truth: the dataclass defaults feed the parser.
    assert ServerArgs(**vars(build_parser().parse_args([]))) == ServerArgs()


def test_all_flags():
    args = parse_args(
        "--model /m --device cpu --dtype bfloat16 --tp 2 --host 0.0.0.0 --port 8000 "
        "--page-size 1 --max-prefill-length 512 --max-running-requests 8 --cache naive "
        "--attn fi,triton --moe-backend torch --cuda-graph-max-bs 0 --memory-ratio 1 --num-pages 100 "
        "--max-model-len 2048 --num-tokenizer 2 --dummy-weights --shell --api-key sk-1 "
        "--seed 42 --log-level DEBUG --max-queued-requests 64 --request-timeout 2.5 "
        "--max-request-bytes 1000 --shutdown-timeout 0".split()
    )
    assert args == ServerArgs(
        model="/m",
        device="cpu",
        dtype="bfloat16",
        tp=2,
        host="0.0.0.0",
        port=8000,
        page_size=1,
        max_prefill_length=512,
        max_running_requests=8,
        cache="naive",
        attn="fi,triton",
        moe_backend="torch",
        cuda_graph_max_bs=0,
        memory_ratio=1.0,
        num_pages=100,
        max_model_len=2048,
        num_tokenizer=2,
        dummy_weights=True,
        shell=True,
        api_key="sk-1",
        seed=42,
        log_level="debug",
        max_queued_requests=64,
        request_timeout=2.5,
        max_request_bytes=1000,
        shutdown_timeout=0.0,
    )
    assert args.attn_backends == ("fi", "triton")


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
    assert parse_args(["--attn", value]).attn_backends == backends


def test_hub_id_model():
    assert parse_args(["--model", "Qwen/Qwen3-0.6B"]).model == "Qwen/Qwen3-0.6B"


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
    assert "--max-prefill-length" in capsys.readouterr().out
