"""Start-up errors fail at once, in one line naming the flag, before any model loads:
- a model that is neither a directory, a .gguf file nor something the Hugging Face hub provides
  (the CLI: `argument --model: ...`, exit 2), never the hub client's traceback; the hub is never
  called here (its download function is replaced);
- a --chat-template path that does not exist (not sent to the model as a literal template);
- a taken port or a host that does not resolve (the socket is bound before the model loads);
- a --max-model-len above the model's context (refused, not cut)."""

import socket
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import errors

from minisgl.ext.serving.template import read_chat_template
from minisgl.models.weight import resolve_model_path
from minisgl.server.args import parse_args
from minisgl.utils.options import OptionError


def hub_error(cls: type[Exception], message: str) -> Exception:
    err = cls.__new__(cls)  # the HTTP errors' constructors want a live response
    Exception.__init__(err, message)
    return err


@pytest.mark.parametrize(
    ("raised", "says"),
    [
        (
            hub_error(errors.LocalEntryNotFoundError, "Got: ConnectError: no route\nlong advice"),
            "the Hugging Face hub is unreachable with no copy cached (ConnectError: no route)",
        ),
        (
            hub_error(errors.RepositoryNotFoundError, "404 Client Error"),
            "is neither a directory nor a Hugging Face repository (a private one needs HF_TOKEN)",
        ),
        (
            hub_error(errors.GatedRepoError, "403 Client Error"),
            "is a gated Hugging Face repository: accept its terms on the hub, then set HF_TOKEN",
        ),
        (
            OSError("[Errno 28] No space left on device\nmore"),
            "the Hugging Face hub could not provide it: [Errno 28] No space left on device",
        ),
    ],
)
def test_hub_failures_become_one_line(monkeypatch, raised, says):
    def download(*args, **kwargs):
        raise raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(OptionError) as info:
        resolve_model_path("org/some-model")
    assert info.value.name == "model"
    assert str(info.value).startswith("'org/some-model' ")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_path_that_is_no_repo_id_names_the_option_asked():
    with pytest.raises(OptionError) as info:
        resolve_model_path("/no/such/dir", "speculative_draft_model_path")
    assert info.value.name == "speculative_draft_model_path"
    assert str(info.value) == (
        "'/no/such/dir' is neither a directory nor a Hugging Face repo id (NAME or ORG/NAME)"
    )


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--model", "/no/such/model"], "--model"),
        (
            ["--speculative-algorithm", "standalone"]
            + ["--speculative-draft-model-path", "/no/such/draft"],
            "--speculative-draft-model-path",
        ),
    ],
)
def test_cli_names_the_flag(tmp_path, flags, flag):
    # the target is any directory: a draft path is checked before anything loads or starts
    done = start(tmp_path, flags)
    assert done.returncode == 2, done.stderr
    assert last_line(done).startswith(f"minisgl: argument {flag}: '/no/such/"), done.stderr


def start(model_dir, flags: list[str]) -> subprocess.CompletedProcess:
    from support.server import free_port

    port = [] if "--port" in flags else ["--port", str(free_port())]  # bound first, then checks
    argv = [sys.executable, "-m", "minisgl", "--model", str(model_dir), "--device", "cpu"]
    argv += [*port, *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def last_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def test_chat_template_path_that_does_not_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--chat-template", str(tmp_path / "chat.jinja")])
    assert exc.value.code == 2
    assert "argument --chat-template: no such file '" in capsys.readouterr().err
    with pytest.raises(OptionError, match="is a directory"):
        read_chat_template(str(tmp_path))
    (tmp_path / "chat.jinja").write_text("{{ messages[0].content }}")
    assert read_chat_template(str(tmp_path / "chat.jinja")) == "{{ messages[0].content }}"
    text = "{% for m in messages %}{{ m.content }}{% endfor %}"  # the template itself
    assert read_chat_template(text) == text and parse_args(["--chat-template", text])


@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"])
def test_taken_port_or_bad_host_fails_before_the_model_loads(tmp_path, host):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:  # the model directory is empty: loading it would fail differently, and later
        done = start(tmp_path, ["--host", host, "--port", str(port)])
    finally:
        holder.close()
    assert done.returncode == 1, done.stderr
    line = last_line(done)
    assert line.startswith(f"minisgl: cannot listen on {host}:{port} (--host, --port): "), line


def test_max_model_len_above_the_context_is_refused(tmp_path, model_dirs):
    from minisgl import LLM
    from support.server import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"), context=256)
    done = start(model, ["--max-model-len", "300"])
    assert done.returncode == 2, done.stderr
    expected = "minisgl: argument --max-model-len: 300 is above the model's context of 256 tokens"
    assert last_line(done).startswith(expected), done.stderr
    with pytest.raises(OptionError, match="above the model's context of 512 tokens") as info:
        LLM(model_dirs("llama")[0], max_model_len=513)
    assert info.value.name == "max_model_len"
    llm = LLM(model_dirs("llama")[0], max_model_len=512, num_pages=64)  # the context itself
    assert llm.engine.max_model_len == 512
    llm.shutdown()


def test_one_api_process_s_socket_refuses_until_uvicorn_listens():
    """Bound early (the port is this server's), listening late: during the model's load a
    client is refused at once instead of waiting in a backlog nobody serves yet."""
    from minisgl.ext.serving.scale import listen_sockets

    (sock,) = listen_sockets("127.0.0.1", 0, 1)
    port = sock.getsockname()[1]
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.listen()
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        sock.close()
