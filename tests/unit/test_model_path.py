"""A model that is neither a directory, a .gguf file nor something the Hugging Face hub provides
fails in one line against its option (the CLI: `argument --model: ...`, exit 2), never with the
hub client's traceback. The hub is never called: its download function is replaced."""

import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import errors

from minisgl.models import resolve_model_path
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
    argv = [sys.executable, "-m", "minisgl", "--model", str(tmp_path), "--device", "cpu", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"minisgl: argument {flag}: '/no/such/"), done.stderr
    assert "Traceback" not in done.stderr
