"""Structured generation with xgrammar: JSON schema, regex, EBNF and structural-tag constraints
(the last: tool calls for `tool_choice` required / named, and constraints after the reasoning).

A request's grammar is compiled in a compiler process as soon as the request arrives (compiled
grammars are cached by their text); meanwhile the request waits in `GrammarState.compiling`,
outside the planner's queue, and joins that queue only once its grammar is ready, so no step
ever waits for a compile: a grammar that takes minutes (a JSON schema of 1,100 nested arrays
keeps xgrammar busy for 1-3 minutes) holds up its own request only, and is stopped after
--grammar-compile-timeout seconds by killing its process. Each step that samples a constrained
request fills that request's row of a token bitmask on the host (xgrammar, several threads) and
the engine applies it to the logits on the device (xgrammar's kernel) before sampling, outside
any CUDA graph. Requests without a grammar touch none of this. `GrammarState` is the
scheduler's side (`grammar_feature.py` attaches it to the scheduler's steps).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_any
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only names: a compiler process runs this file without importing minisgl,
    # and the API process (grammar_key) without torch
    import torch
    import xgrammar

    from minisgl.core import Req, SamplingParams

CACHE_SIZE = 256  # compiled grammars kept (failures too: the same bad schema fails at once)
COMPILE_TIMEOUT_S = 30.0  # --grammar-compile-timeout's default
MAX_WORKERS = 4  # compiler processes per tokenizer: a slow grammar holds one, the others go on
WORKER_START_TIMEOUT_S = 120.0  # a compiler process imports xgrammar (and torch): ~2-3 s
PARENT_POLL_S = 0.5  # how often a compiler process checks that its scheduler is still there
# A pool that no GrammarCompiler uses any more stops its processes only after this long: one
# built again over the same tokenizer takes it over (tests do; a process takes seconds to start)
LINGER_S = 5.0
WAIT_POLL_S = 0.05  # Constraint.wait's poll (its deadline moves once the compile starts)
# A TP follower's compile budget: rank 0 decides (its deadline), and a grammar it admitted must
# not fail on a follower, whose compile started with rank 0's but may run slower (shared CPUs)
FOLLOWER_BUDGET = (2.0, 10.0)  # (factor, extra seconds) of --grammar-compile-timeout
GRAMMAR = "grammar"  # a constrained request's key in Req.ext (its Constraint)


def timed_out(seconds: float) -> str:
    return f"grammar compilation took longer than {seconds:g} s"


TIMED_OUT = timed_out(COMPILE_TIMEOUT_S)


class GrammarError(ValueError):
    """A grammar that does not compile; the message is the compiler's."""


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's constraint (one of CONSTRAINT_KINDS), or None."""
    from minisgl.core import CONSTRAINT_KINDS

    for kind in CONSTRAINT_KINDS:
        text = params.get(kind)
        if text is not None:
            return kind, text
    return None


@dataclass
class TokenMask:
    """The tokens allowed in some rows of a batch's logits. `bitmask`: int32 [B, ceil(V / 32)]
    in host memory (xgrammar's layout), bit 1 = allowed; `rows`: the rows it applies to."""

    bitmask: torch.Tensor
    rows: list[int]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set to -inf, in the mask's rows of `logits`, the tokens whose bit is 0."""
    import torch
    import xgrammar as xgr

    from minisgl.core import to_device

    bitmask, rows = mask.bitmask, mask.rows
    bitmask = bitmask.to(logits.device, non_blocking=True)  # pinned by the scheduler on CUDA
    if logits.is_cuda:  # rows as a device tensor: xgrammar would copy a list from pageable memory
        indices = to_device(rows, torch.int32, logits.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)  # type: ignore[arg-type]
        return
    if logits.dtype == torch.float32:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return
    scratch = logits.float()  # xgrammar's CPU kernel takes float32 only
    xgr.apply_token_bitmask_inplace(scratch, bitmask, indices=rows)
    logits.copy_(scratch)


def _clean(error: Exception) -> str:
    """xgrammar's C++ messages start with a timestamp, a source location and an assertion."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _compile(
    compiler: xgrammar.GrammarCompiler, kind: str, text: str, any_whitespace: bool
) -> xgrammar.CompiledGrammar:
    """`any_whitespace`: JSON schemas allow free whitespace between elements (default: compact
    separators, so a model cannot wander off into endless whitespace)."""
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "structural_tag":  # the format-dict form: {"type": "structural_tag", ...}
            return compiler.compile_structural_tag(text)
        return compiler.compile_grammar(text)
    except Exception as e:  # xgrammar raises RuntimeError, but no input may crash the server
        raise GrammarError(f"invalid {kind}: {_clean(e)}") from None


# ---- a compiler process -------------------------------------------------------------------
def serve_compiles(jobs_fd: int, results_fd: int, parent: int) -> None:
    """A compiler process's loop (`_Worker` runs this file by its path: no minisgl import, so no
    engine): the tokenizer as xgrammar's JSON, then one (kind, text, any_whitespace) at a time,
    each answered with ("ok", the compiled grammar as xgrammar's JSON) or ("error", message).
    It ends when the scheduler closes the pipe, or is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    import xgrammar as xgr

    jobs, results = Connection(jobs_fd, writable=False), Connection(results_fd, readable=False)
    try:
        info = xgr.TokenizerInfo.deserialize_json(jobs.recv())
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        results.send(("ready", ""))
        while True:
            kind, text, any_whitespace = jobs.recv()
            try:
                answer = ("ok", _compile(compiler, kind, text, any_whitespace).serialize_json())
            except GrammarError as e:
                answer = ("error", str(e))
            results.send(answer)
    except (EOFError, BrokenPipeError):  # the scheduler closed its ends: shut down
        pass


def _exit_with_parent(parent: int) -> None:
    """A compile cannot be interrupted, but it holds no GIL: this thread still runs."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


# `python grammar.py` would put scheduler/ first on sys.path, where queue.py and io.py would
# shadow the standard library's modules: run this file through runpy instead
_RUN_FILE = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


class _Lost(Exception):
    """The compiler process is gone: crashed, did not start, or killed for overrunning."""


class CompileJob(Future):
    """A grammar to compile, and the future of its xgrammar CompiledGrammar (GrammarError when
    it does not compile within `budget` seconds of its start)."""

    def __init__(self, kind: str, text: str, any_whitespace: bool, budget: float) -> None:
        super().__init__()
        self.kind, self.text, self.any_whitespace, self.budget = kind, text, any_whitespace, budget
        self.started_at: float | None = None  # when a compiler process took it


class _Worker:
    """One compiler process. xgrammar cannot stop a compile, so one that overruns its budget is
    stopped by killing its process. A subprocess, not multiprocessing: the server's scheduler is
    a daemon process, which multiprocessing does not let start children; and exec'd afresh, it
    inherits nothing of a scheduler with CUDA initialised. Cost: ~2-3 s to start and ~250 MB
    (xgrammar imports torch); a compiled grammar travels back as xgrammar's JSON, a few ms for
    ordinary schemas (~100-150 KB with a 49k vocabulary), far more for deeply nested ones,
    whose serialization the budget bounds with their compile."""

    def __init__(self, info_json: str) -> None:
        jobs_r, jobs_w = os.pipe()
        results_r, results_w = os.pipe()
        args = [_RUN_FILE, __file__, str(jobs_r), str(results_w), str(os.getpid())]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", *args], pass_fds=(jobs_r, results_w), stdin=subprocess.DEVNULL
        )
        os.close(jobs_r)
        os.close(results_w)
        self.jobs = Connection(jobs_w, readable=False)
        self.results = Connection(results_r, writable=False)
        self.info_json, self.ready = info_json, False

    def run(self, job: CompileJob) -> str:
        """The compiled grammar as xgrammar's JSON; GrammarError when it does not compile;
        _Lost when the process is gone or overruns the job's budget (then `close` it)."""
        try:
            if not self.ready:  # the first job waits for the start, which is not its time
                self.jobs.send(self.info_json)
                self._answer(WORKER_START_TIMEOUT_S, "the grammar compiler process did not start")
                self.ready = True
            job.started_at = time.monotonic()
            self.jobs.send((job.kind, job.text, job.any_whitespace))
        except OSError:  # the pipe is broken: the process died
            raise self._gone() from None
        status, value = self._answer(job.budget, timed_out(job.budget))
        if status == "error":
            raise GrammarError(value)
        return value

    def _answer(self, timeout: float, overdue: str) -> tuple[str, str]:
        try:
            if self.results.poll(timeout):
                return self.results.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        raise _Lost(overdue)

    def _gone(self) -> _Lost:
        try:
            code: int | None = self.proc.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        return _Lost(f"the grammar compiler process ended (exit code {code})")

    def stop(self) -> None:
        """Kill the process (any thread: its own sees the pipe close)."""
        self.proc.kill()

    def close(self) -> None:
        """Kill the process and release its pipes (the thread that runs its jobs only)."""
        self.proc.kill()
        self.proc.wait()
        self.jobs.close()
        self.results.close()


class _Pool:
    """The compiler processes for one tokenizer, shared by every GrammarCompiler over it (tests
    build many; a process takes seconds to start): up to MAX_WORKERS, each run by a thread of
    its own, started one at a time while compiles wait for a free one, then kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.cond = threading.Condition()
        self.pending: deque[CompileJob] = deque()
        self.threads = self.busy = 0  # threads started; of those, with a job
        self.workers: set[_Worker] = set()
        self.closed = False
        self.users = 0  # GrammarCompilers over it
        self.info_lock = threading.Lock()
        self.info: xgrammar.TokenizerInfo | None = None  # built by the first job (not at once:
        self.info_json = ""  # tokenizer analysis takes a while for large vocabularies)

    def submit(self, job: CompileJob) -> None:
        with self.cond:
            self.pending.append(job)
            if len(self.pending) + self.busy > self.threads and self.threads < MAX_WORKERS:
                self.threads += 1
                threading.Thread(target=self._serve, name="grammar", daemon=True).start()
            self.cond.notify()

    def _take(self) -> CompileJob | None:
        with self.cond:
            while not self.pending and not self.closed:
                self.cond.wait()
            if self.closed:
                return None
            self.busy += 1
            return self.pending.popleft()

    def _serve(self) -> None:
        """One compiler process's jobs, one at a time; a lost process is replaced at the next."""
        worker: _Worker | None = None
        while (job := self._take()) is not None:
            try:
                worker = worker or self._start_worker()
                job.set_result(self._compiled(worker.run(job)))
            except GrammarError as e:
                job.set_exception(e)
            except _Lost as e:
                job.set_exception(GrammarError(str(e)))
                self._retire(worker)
                worker = None
            except Exception as e:  # never leave a request waiting for a job nobody runs
                job.set_exception(GrammarError(f"grammar compiler failed: {e}"))
            finally:
                with self.cond:
                    self.busy -= 1
        self._retire(worker)

    def _compiled(self, serialized: str) -> xgrammar.CompiledGrammar:
        import xgrammar as xgr

        assert self.info is not None, "built before the first process started"
        return xgr.CompiledGrammar.deserialize_json(serialized, self.info)

    def _start_worker(self) -> _Worker:
        with self.info_lock:
            if self.info is None:
                import xgrammar as xgr

                info = self.tokenizer  # an xgrammar TokenizerInfo itself (benchmarks), or HF's
                if not isinstance(info, xgr.TokenizerInfo):
                    info = xgr.TokenizerInfo.from_huggingface(
                        info, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                    )
                self.info, self.info_json = info, info.serialize_json()
        worker = _Worker(self.info_json)
        with self.cond:
            self.workers.add(worker)
            if self.closed:
                worker.stop()
        return worker

    def _retire(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.close()
            with self.cond:
                self.workers.discard(worker)

    def close(self) -> None:
        """Kill the processes (their threads end) and cancel the compiles not started."""
        with self.cond:
            self.closed = True
            jobs, self.pending = list(self.pending), deque()
            for worker in self.workers:
                worker.stop()
            self.cond.notify_all()
        for job in jobs:
            job.cancel()


# one pool per tokenizer object, which it holds (so the object's id stays its own)
_POOLS: dict[tuple[int, int, tuple[int, ...]], _Pool] = {}
_POOLS_LOCK = threading.Lock()


class GrammarCompiler:
    """Compiled grammars by their text, for one tokenizer and vocabulary: compiled by the
    tokenizer's compiler processes, each within `budget` seconds of its start (then its process
    is killed: the grammar fails as timed out, and stays failed in the cache). Nothing starts
    before the first grammar, so a server whose clients never ask for one never pays.
    `any_whitespace`: `_compile`'s."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = False,
        budget: float = COMPILE_TIMEOUT_S,
    ) -> None:
        if tokenizer is None:
            raise GrammarError("this model has no tokenizer: constrained decoding needs one")
        self.any_whitespace, self.budget = any_whitespace, budget
        self.cache: OrderedDict[tuple[str, str], CompileJob] = OrderedDict()
        self.lock = threading.Lock()
        self.key = (id(tokenizer), vocab_size, tuple(stop_token_ids))
        with _POOLS_LOCK:
            pool = _POOLS.get(self.key)
            if pool is None:
                pool = _POOLS[self.key] = _Pool(tokenizer, vocab_size, stop_token_ids)
            pool.users += 1
        self.pool: _Pool | None = pool

    def compile(self, key: tuple[str, str]) -> CompileJob:
        """The compile of this grammar (from the cache when this text was seen before)."""
        with self.lock:
            job = self.cache.get(key)
            if job is not None:
                self.cache.move_to_end(key)
                return job
            job = self.cache[key] = CompileJob(*key, self.any_whitespace, self.budget)
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        if self.pool is None:
            job.set_exception(GrammarError("the grammar compiler is shut down"))
        else:
            self.pool.submit(job)
        return job

    def shutdown(self) -> None:
        """Let go of the pool; the last compiler over it stops its processes (LINGER_S later)."""
        with _POOLS_LOCK:
            pool, self.pool = self.pool, None
            if pool is None:
                return
            pool.users -= 1
            if pool.users > 0:
                return
        timer = threading.Timer(LINGER_S, _close_unused, args=(self.key, pool))
        timer.daemon = True
        timer.start()


def _close_unused(key: tuple[int, int, tuple[int, ...]], pool: _Pool) -> None:
    with _POOLS_LOCK:
        if pool.users > 0 or _POOLS.get(key) is not pool:
            return
        del _POOLS[key]
    pool.close()


class Constraint:
    """One request's grammar: the compile in progress, then the matcher that follows the
    tokens the request has generated."""

    def __init__(self, future: Future, timeout: float = COMPILE_TIMEOUT_S) -> None:
        self.future, self.timeout = future, timeout
        self.matcher: xgrammar.GrammarMatcher | None = None
        # `timeout` from the request's arrival, or from its compile's start if that was later
        # (it waited for a compiler process to start or to be free: not the grammar's fault;
        # each compiles for at most its budget, so that wait is bounded)
        self.deadline = time.monotonic() + timeout

    def _late(self) -> bool:
        started = self.future.started_at if isinstance(self.future, CompileJob) else -math.inf
        if started is None:  # not started yet
            return False
        return time.monotonic() > max(self.deadline, started + self.timeout)

    def failure(self) -> str | None:
        """The compile error if compilation has ended with one, or has run past its deadline
        (does not wait): such a request is never admitted."""
        if self.future.cancelled():
            return "the grammar compiler was shut down"
        if self.future.done():
            error = self.future.exception()
            return None if error is None else str(error)
        return timed_out(self.timeout) if self._late() else None

    def wait(self, bounded: bool = True) -> xgrammar.GrammarMatcher:
        """The matcher, once the grammar is compiled; GrammarError if it does not compile, or
        (`bounded`) if it passes the deadline first. Unbounded: a TP follower's, for a request
        that rank 0 admitted (its grammar compiled there in time)."""
        if self.matcher is None:
            import xgrammar as xgr

            while bounded and not self.future.done():
                if self._late():
                    raise GrammarError(timed_out(self.timeout))
                wait_for_any([self.future], WAIT_POLL_S)
            self.matcher = xgr.GrammarMatcher(self.future.result())
        return self.matcher

    def accept(self, token: int) -> bool:
        return self.wait().accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarState:
    """The scheduler's side of structured generation: the compiler and the token bitmask, each
    built on first use (a server whose clients never ask for a grammar never loads xgrammar),
    the constrained requests whose grammar is not ready yet (`compiling`, in arrival order:
    outside the planner's queue, which they join once it is; the scheduler's `held` when
    attached to one), and the count of constrained
    requests (0 skips every grammar check). The bitmask (host memory) is reused: a step with
    constraints waits for the previous one with constraints, so its copy is done by then.
    `any_whitespace`: GrammarCompiler's; `timeout`: a request's compile deadline (seconds);
    `leads`: False on TP followers, which admit what rank 0 admits (their compiles get the
    longer FOLLOWER_BUDGET)."""

    def __init__(
        self,
        vocab_size: int,
        max_rows: int,
        pin: bool,
        any_whitespace: bool = False,
        timeout: float = COMPILE_TIMEOUT_S,
        leads: bool = True,
    ) -> None:
        self.vocab_size, self.max_rows, self.pin = vocab_size, max_rows, pin
        self.any_whitespace, self.timeout, self.leads = any_whitespace, timeout, leads
        self.compiler: GrammarCompiler | None = None
        self.bitmask: torch.Tensor | None = None
        self.filler: Any = None  # xgrammar.BatchGrammarMatcher: fills rows on several threads
        self.num_constrained = 0
        self.compiling: list[Req] = []

    def constraint(
        self, params: SamplingParams, tokenizer: Any, stop_token_ids: set[int]
    ) -> Constraint | None:
        """The request's constraint, compiling in a compiler process from now on, or None."""
        key = grammar_key(params)
        if key is None:
            return None
        if self.compiler is None:
            factor, extra = (1.0, 0.0) if self.leads else FOLLOWER_BUDGET
            self.compiler = GrammarCompiler(
                tokenizer,
                self.vocab_size,
                sorted(stop_token_ids),
                self.any_whitespace,
                budget=factor * self.timeout + extra,
            )
        return Constraint(self.compiler.compile(key), self.timeout)

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """Rank 0, each step, without waiting: the compiling requests whose grammar is ready,
        in arrival order, and (request, error) for those whose compile failed or passed its
        deadline. They stay in `compiling` until admitted or finished."""
        ready, failed = [], []
        for req in self.compiling:
            grammar: Constraint = req.ext[GRAMMAR]
            failure = grammar.failure()
            if failure is not None:
                failed.append((req, failure))
            elif grammar.future.done():
                ready.append(req)
        return ready, failed

    def mask(self, reqs: list[Req], samples: list[bool]) -> TokenMask | None:
        """The token bitmask of the requests that sample under a grammar. Their grammars are
        compiled (rank 0 admits a request only then), except that a TP follower may wait here
        for its own compile of a grammar rank 0 admitted (started at the same time)."""
        matchers, rows = [], []
        for i, (req, sampled) in enumerate(zip(reqs, samples)):
            if sampled and GRAMMAR in req.ext and not req.finished:
                matchers.append(req.ext[GRAMMAR].wait(bounded=False))
                rows.append(i)
        if not rows:
            return None
        if self.bitmask is None:
            import torch
            import xgrammar as xgr

            shape = xgr.get_bitmask_shape(self.max_rows, self.vocab_size)
            self.bitmask = torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=self.pin)
            self.filler = xgr.BatchGrammarMatcher()
        bitmask = self.bitmask[: len(reqs)]
        self.filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return TokenMask(bitmask, rows)

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()


if __name__ == "__main__":  # a compiler process: `_Worker` runs this file by its path
    serve_compiles(*(int(arg) for arg in sys.argv[1:4]))
