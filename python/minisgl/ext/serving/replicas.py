"""`LLM(dp=N)`: N data-parallel replicas, each a whole `LLM` (scheduler and engine, a TP group of
`tp` processes) in a process of its own on GPUs of its own (replica r: the r-th `tp` of the
visible GPUs; on CPU an equal share of the cores). `generate` sends each prompt, with all its
`n` samples, to one replica, chosen by the server's --dp dispatcher (the replica already holding
the longest prefix of the prompt, new prefixes spread evenly), and returns results in order."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from tqdm import tqdm

from minisgl.core import SamplingParams
from minisgl.ext.serving.dispatch import Dispatcher

STOP_TIMEOUT_S = 30.0  # a replica's own shutdown (its TP ranks included) on a loaded machine


def replica_placements(dp: int, tp: int, device: str) -> list[dict[str, str]]:
    """Environment of each replica: its slice of CUDA_VISIBLE_DEVICES on a GPU, its thread
    count on CPU. ValueError when the GPUs are too few or `device` names one GPU."""
    if device.startswith("cuda:"):
        raise ValueError(
            f"LLM(dp=..., device={device!r}): replicas take the visible GPUs in order; "
            "choose them with CUDA_VISIBLE_DEVICES"
        )
    import torch  # here: the package registers this module in processes without torch

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not on_gpu:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // dp))
        return [{"OMP_NUM_THREADS": threads}] * dp
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < dp * tp:
        raise ValueError(f"LLM(dp={dp}, tp={tp}) needs {dp * tp} GPUs, found {len(gpus)}")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])} for r in range(dp)]


def _sendable(error: BaseException) -> BaseException:
    """The error itself when it pickles (a ValueError stays one), else its text."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def serve_replica(
    llm_class: type,
    model: str,
    tp: int,
    options: dict[str, Any],
    env: dict[str, str],
    conn: Connection,
) -> None:
    """A replica's process: build its LLM, then answer (method name, args) calls until told to
    stop or until the parent is gone (its end of the pipe closes)."""
    os.environ.update(env)  # before anything touches CUDA
    import torch  # here: the package registers this module in processes without torch

    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        llm = llm_class(model, tp=tp, **options)
    except BaseException as e:
        conn.send(("error", _sendable(e)))
        return
    conn.send(("ready", None))
    try:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                break
            if method == "stop":
                break
            try:
                value = getattr(llm, method)  # a method, or a property's value
                conn.send(("ok", value(*args) if callable(value) else value))
            except Exception as e:
                conn.send(("error", _sendable(e)))
    finally:
        llm.shutdown()


class Replicas:
    """The parent's side: one process and pipe per replica."""

    def __init__(
        self,
        llm_class: type,
        model: str,
        tp: int,
        dp: int,
        options: dict[str, Any],
        dispatcher: Dispatcher,
    ) -> None:
        placements = replica_placements(dp, tp, str(options.get("device", "auto")))
        ctx = mp.get_context("spawn")
        self.dispatcher = dispatcher
        self.conns: list[Connection] = []
        # not daemons: a replica with tp > 1 starts processes of its own
        self.procs: list[Any] = []
        for r, env in enumerate(placements):
            conn, child = ctx.Pipe()
            args = (llm_class, model, tp, options, env, child)
            proc = ctx.Process(target=serve_replica, args=args, name=f"dp replica {r}")
            proc.start()
            child.close()
            self.conns.append(conn)
            self.procs.append(proc)
        try:
            for r in range(dp):
                self._answer(r, ready=True)  # they start at once; an error raises as itself
        except BaseException:
            self.shutdown()
            raise

    def _answer(self, r: int, ready: bool = False) -> Any:
        """Replica r's reply to the last call (raising its error, or naming its death)."""
        try:
            kind, value = self.conns[r].recv()
        except EOFError:  # only the child held the other end
            self._died(r)
        if kind == "error":
            raise value
        assert kind == ("ready" if ready else "ok"), kind
        return value

    def _died(self, r: int) -> NoReturn:
        """Replica r is gone: the others stop too (as the server stops), and the call fails."""
        self.procs[r].join(5)
        code = self.procs[r].exitcode
        self.shutdown()
        raise RuntimeError(f"dp replica {r} died (exit code {code}); all replicas stopped")

    def _check_open(self) -> None:
        if not self.conns:
            raise RuntimeError("the dp replicas were shut down")

    def _send(self, r: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            self.conns[r].send((method, args))
        except (BrokenPipeError, ConnectionResetError):
            self._died(r)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        self._check_open()
        for r in range(len(self.conns)):
            self._send(r, method, args)
        return self._gather(range(len(self.conns)))

    def _gather(self, replicas: Sequence[int], bar: tqdm | None = None) -> list[Any]:
        """Every named replica's answer; the first error is raised once all have answered (the
        pipes stay in step for the next call)."""
        answers: list[Any] = []
        error: BaseException | None = None
        for r in replicas:
            try:
                answers.append(self._answer(r))
            except RuntimeError as e:
                if not self.conns:  # a replica died: nothing more to read
                    raise
                answers.append(None)
                error = error or e
            except Exception as e:
                answers.append(None)
                error = error or e
            if bar is not None and answers[-1] is not None:
                bar.update(len(answers[-1]))
        if error is not None:
            raise error
        return answers

    def generate(
        self, prompts: list[list[int]], params: Sequence[SamplingParams], use_tqdm: bool
    ) -> list[dict[str, Any]]:
        self._check_open()
        shares: list[list[int]] = [[] for _ in self.conns]  # prompt indices per replica
        for i, ids in enumerate(prompts):
            r = self.dispatcher.choose(ids)
            self.dispatcher.sent(i, r, ids)
            shares[r].append(i)
        for i in range(len(prompts)):
            self.dispatcher.done(i)  # all answered at once below: loads count one call's share
        busy = [r for r, share in enumerate(shares) if share]
        for r in busy:
            share = shares[r]
            self._send(
                r, "generate", ([prompts[i] for i in share], [params[i] for i in share], False)
            )
        results: list[dict[str, Any]] = [{} for _ in prompts]
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            for r, answer in zip(busy, self._gather(busy, bar)):
                for i, result in zip(shares[r], answer):
                    results[i] = result
        return results

    def shutdown(self) -> None:
        """Stop every replica (idempotent); one that does not stop in time is killed."""
        for conn in self.conns:
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass  # already gone
        for proc in self.procs:
            proc.join(STOP_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def replicated_llm() -> type:
    """The `replicas` point: `LLM(dp=N)`'s class (imported on use: it loads the engine)."""
    from minisgl.ext.serving.llm_dp import ReplicatedLLM

    return ReplicatedLLM
