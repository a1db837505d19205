"""Shared fixtures. Tests are grouped by layer (unit/, kernels/, engine/, server/, gpu/);
helpers live in support/ (tests/ is on sys.path through pytest's `pythonpath`). A test that
needs CUDA carries `@pytest.mark.gpu` and nothing else: here it is skipped without a GPU, and
`pytest -m gpu` selects every GPU test.

No orphans (issue 47): however pytest ends, the servers its tests started end too. Servers a
test left running are killed after the session's teardown, at interpreter exit and on SIGTERM /
SIGHUP (then every other process below pytest gets SIGTERM, and pytest dies of the signal as it
would have); servers run with --exit-with-parent (the serving extension's) for a pytest killed
outright (`support/server.py`)."""

import importlib.util
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# One compute thread per process: the tests' models are tiny, so a second thread only spins in
# barriers, and with two pytest workers (README: `-n 2`) and the servers they start, spinning
# threads took the cores from work (the suite: 750 s serially with 2 threads, 527 s with -n 2
# and 1). Server children inherit it. A run may still choose: OMP_NUM_THREADS=2 pytest ...
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

from support.cache import KERNELS_ENV, link_kernels, shared_kernels
from support.models import save_model
from support.server import Server, SharedServers, alive, descendants, kill_tracked

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# The exact path: `--dtype auto` on a CPU with bf16 instructions would pick bfloat16 (and the
# quantized GGUF layers); tests compare float32 with transformers. Server children inherit it.
os.environ["MINISGL_CPU_FLOAT32"] = "1"
# No decoder compiled ahead of time (~15 s for each quantized model a test builds): the tests
# of that path (tests/engine/test_cpu_aot.py) turn it on.
os.environ.setdefault("MINISGL_CPU_AOT", "0")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_previous_handlers: dict[int, Any] = {}


def _stop_on_signal(signum: int, frame: Any) -> None:
    """Kill what the tests started, then end as the signal's previous handler would (by default
    pytest dies of it: no test runs on)."""
    signal.signal(signum, signal.SIG_IGN)  # a second one (an impatient CI) must not cut this short
    others = descendants(os.getpid())  # before the servers die: their children get re-parented
    kill_tracked()
    for pid, _ in alive(others):  # e.g. a test's own `python -m minisgl` in no session of its own
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the package once: with PYTHONDONTWRITEBYTECODE set (as on CI's machine)
    every server process and subprocess the tests start would compile its modules again."""
    import compileall

    import minisgl

    compileall.compile_dir(os.path.dirname(minisgl.__file__), quiet=1, workers=1)


def pytest_configure(config: pytest.Config) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread (pytester, some runners)
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)
        if previous in (signal.SIG_IGN, _stop_on_signal) or previous is None:
            continue  # ignored on purpose (nohup), or set already; None: not set from Python
        _previous_handlers[sig] = previous
        signal.signal(sig, _stop_on_signal)


def pytest_unconfigure(config: pytest.Config) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig, previous in _previous_handlers.items():
            signal.signal(sig, previous)
    _previous_handlers.clear()


@pytest.hookimpl(trylast=True)  # after the session's fixtures stopped their servers
def pytest_sessionfinish(session: pytest.Session) -> None:
    if left := kill_tracked():
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"killed {len(left)} server(s) left running by the tests:")
            for line in left:
                reporter.write_line(f"  {line}", yellow=True)


# The core's own subset (`pytest -m core`), which CI also runs on a copy of the package without
# minisgl/ext (.ci/run): exactness against transformers for every architecture, TP on CPU, the
# server's endpoints, streaming and errors, LLM, the shell, and the refusals of extensions'
# features. Every test of these modules must pass with the core alone.
CORE_MODULES = frozenset(
    {
        "unit/test_core_boundary.py",
        "unit/test_light_processes.py",
        "unit/test_kvcache.py",
        "unit/test_scheduler.py",
        "unit/test_message.py",
        "unit/test_detokenize.py",
        "unit/test_stop_matched.py",
        "engine/test_models.py",
        "engine/test_tp.py",
        "engine/test_llm.py",
        "server/test_server.py",
        "server/test_streaming.py",
        "server/test_ext_structured_http.py",
        "server/test_ext_sampling_http.py",
    }
)


# The edit-test loop's subset (`pytest -q tests/unit -m quick`, about a minute on 2 cores, README):
# tests/unit without its modules that start servers, processes or real models.
QUICK_LEFT_OUT = frozenset(
    {
        "unit/test_ab.py",
        "unit/test_bench.py",
        "unit/test_bench_cpu.py",
        "unit/test_errors.py",
        "unit/test_ext_cpu.py",
        "unit/test_ext_serving.py",
        "unit/test_procs.py",
        "unit/test_start_errors.py",
        "unit/test_timeline.py",
    }
)


EXT_PRESENT = importlib.util.find_spec("minisgl.ext") is not None


def pytest_ignore_collect(collection_path: Any, config: Any) -> bool | None:
    """Without minisgl/ext (the core alone) only the core's modules and the extensions' refusal
    tests (test_ext_*.py, whose core tests carry the mark) are collected: the others may import
    an extension."""
    if EXT_PRESENT or collection_path.suffix != ".py":
        return None
    relative = os.path.relpath(str(collection_path), os.path.dirname(__file__))
    if relative in CORE_MODULES or collection_path.name.startswith(("test_ext_", "conftest")):
        return None
    return True


def pytest_collection_modifyitems(config, items) -> None:
    tests_dir = os.path.dirname(__file__)
    alone = not EXT_PRESENT or os.environ.get("MINISGL_DISABLE_EXTENSIONS") == "1"
    for item in items:
        relative = os.path.relpath(str(item.path), tests_dir)
        if relative in CORE_MODULES:
            item.add_marker(pytest.mark.core)
        if relative.startswith("unit" + os.sep) and relative not in QUICK_LEFT_OUT:
            item.add_marker(pytest.mark.quick)
        if alone and item.get_closest_marker("ext") is not None:
            item.add_marker(pytest.mark.skip(reason="needs minisgl/ext (the core runs alone)"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def core_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as the core alone: the flag set and an empty extension registry (the
    extensions' modules, imported by other tests, have filled the process's own)."""
    from minisgl import extension

    monkeypatch.setenv("MINISGL_DISABLE_EXTENSIONS", "1")
    monkeypatch.setattr(extension, "_EXTENSIONS", extension.Extensions())


@pytest.fixture(scope="session", autouse=True)
def minisgl_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Conversions (GGUF, packed layers) go to a cache of this session's, shared by its tests
    and the servers they start, never to the user's ~/.cache/minisgl; the native kernels to
    one folder of the whole run (support/cache.py: built once, not once a worker)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KERNELS_ENV, shared_kernels(str(tmp_path_factory.getbasetemp())))
        cache = link_kernels(tmp_path_factory.mktemp("minisgl-cache"))
        mp.setenv("MINISGL_CACHE_DIR", cache)
        yield cache
    shutil.rmtree(cache)  # the embedded model's entry: 162 MB (700 with its float32 copy)


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """`shared_server(*args, extra_env=..., script=...)`: the session's tiny server (random, or
    scripted) started with these arguments, one for every module that asks for the same
    (support/server.py's SharedServers:
    only for tests that leave it running and undisturbed), stopped and checked at the end."""
    servers = SharedServers(tmp_path_factory)
    yield servers.get
    servers.stop_all()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model), built once per test session."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            cache[arch] = (path, save_model(arch, path))
        return cache[arch]

    return get
