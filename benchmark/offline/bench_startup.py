"""Start-up of the shell: seconds from `python -m minisgl --shell` to its prompt, and from a
question to the end of its answer; a cold first start (an empty cache: the GGUF's conversion)
then warm starts, each a fresh process, with the load average before each and the CPU seconds
each of its processes had used at the prompt.

    python benchmark/offline/bench_startup.py                  # embedded model: 1 cold, 3 warm
    python benchmark/offline/bench_startup.py --warm 5 --no-cold --cache-dir DIR --trace
    python benchmark/offline/bench_startup.py --model DIR -- --page-size 4   # extra shell flags

The cache is a temporary MINISGL_CACHE_DIR (removed at the end), never ~/.cache; --cache-dir
keeps one across runs. --trace prints every output line of the first timed start with its
offset from the launch (add `-- --log-level debug` for the processes' own steps)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import pexpect

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HELP = "/exit (or Ctrl-D) quits."
PROMPT = "\r\n> "  # prompt_toolkit on a dumb terminal: the prompt on a line of its own


class Trace:
    """pexpect's logfile_read: every chunk the shell printed, with its time."""

    def __init__(self, t0: float) -> None:
        self.t0, self.text = t0, ""
        self.lines: list[tuple[float, str]] = []  # (seconds since the launch, the line)

    def write(self, chunk: str) -> None:
        self.text += chunk
        *done, self.text = self.text.split("\n")
        self.lines += [(time.monotonic() - self.t0, line.rstrip("\r")) for line in done]

    def flush(self) -> None:
        pass


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) each process of the shell has used so far, by its title:
    where a start's work goes on cores it shares (Linux; empty elsewhere)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline") as f:
                title = f.read().split("\0")[0]
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pending += [int(c) for c in f.read().split()]
        except OSError:  # not Linux, or it ended meanwhile
            continue
        name = "shell" if pid == root else title.removeprefix("minisgl::").split("/")[-1]
        out[name] = round((int(fields[11]) + int(fields[12])) / tick, 2)
    return out


def start_env(cache: str) -> dict[str, str]:
    """A start's environment: minisgl's cache and inductor's inside `cache`, so that a cold
    start compiles as on a machine that never ran torch's compiler. (Inductor keeps precompiled
    headers in /tmp/torchinductor_$USER whatever its cache: minisgl's builds make none now, but
    an older tree's cold start is fresh only with that folder's precompiled_headers moved.)"""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), TERM="dumb")
    env["MINISGL_CACHE_DIR"] = cache
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    return env


def one_start(args: argparse.Namespace, cache: str, question: str) -> dict[str, Any]:
    """One start of the shell: its prompt's and its first answer's seconds, the answer."""
    env = start_env(cache)
    cmd = ["-m", "minisgl", "--shell"] + (["--model", args.model] if args.model else [])
    load = os.getloadavg()
    t0 = time.monotonic()
    child = pexpect.spawn(
        sys.executable, cmd + args.extra, cwd=REPO, env=env, encoding="utf-8",
        codec_errors="replace", timeout=args.timeout, dimensions=(50, 400),
    )  # fmt: skip
    child.logfile_read = trace = Trace(t0)
    try:
        child.expect_exact(HELP)
        child.expect_exact(PROMPT[2:])
        prompt_s = time.monotonic() - t0
        cpu = cpu_seconds(child.pid)
        child.sendline(question)
        t1 = time.monotonic()
        child.expect_exact(question)  # the terminal's echo
        child.expect_exact(PROMPT)
        answer_s = time.monotonic() - t1
        answer = child.before.strip().removeprefix(question).strip()
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    except pexpect.ExceptionPexpect:
        print("\n".join(f"  {t:7.2f}  {line}" for t, line in trace.lines[-30:]), file=sys.stderr)
        raise
    finally:
        child.close(force=True)
    return {
        "prompt_s": round(prompt_s, 2),
        "answer_s": round(answer_s, 2),
        "load": [round(x, 2) for x in load],
        "answer": answer[:60],
        "cpu_s": cpu,
        "trace": trace.lines,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--warm", type=int, default=3, help="warm starts after the cold one")
    p.add_argument("--no-cold", action="store_true", help="warm starts only (on --cache-dir)")
    p.add_argument("--cache-dir", help="MINISGL_CACHE_DIR to use and keep (default: a temp dir)")
    p.add_argument("--question", default="What is 2+2?")
    p.add_argument("--timeout", type=float, default=300, help="seconds for one step at most")
    p.add_argument("--trace", action="store_true", help="the first start's lines, timed")
    p.add_argument("--json", help="append one JSON line per start to this file")
    p.add_argument("extra", nargs="*", help="after --: flags for `python -m minisgl --shell`")
    args = p.parse_args()
    if args.no_cold and not args.cache_dir:
        p.error("--no-cold needs --cache-dir (a cache the model was converted into)")
    return args


def main() -> None:
    args = parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="minisgl-bench-cache-")
    kinds = ([] if args.no_cold else ["cold"]) + ["warm"] * args.warm
    runs: list[dict[str, Any]] = []
    try:
        for i, kind in enumerate(kinds):
            if kind == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            run = {"kind": kind, **one_start(args, cache, args.question)}
            runs.append(run)
            print(
                f"{kind:4} start {i}: prompt {run['prompt_s']:6.2f} s, answer {run['answer_s']:5.2f} s"
                f"  (load {' '.join(map(str, run['load']))})  {run['answer']!r}",
                flush=True,
            )
            print(f"    CPU seconds at the prompt: {run['cpu_s']}")
            if args.trace and i == 0:
                for t, line in run["trace"]:
                    print(f"    {t:7.2f}  {line[:150]}")
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)
    warm = [r for r in runs if r["kind"] == "warm"]
    if warm:
        med = {k: statistics.median(r[k] for r in warm) for k in ("prompt_s", "answer_s")}
        print(f"warm median: prompt {med['prompt_s']:.2f} s, answer {med['answer_s']:.2f} s")
    if args.json:
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
        about = {"bench": "startup", "date": stamp, "commit": head.stdout.strip() or None}
        about["command"] = shlex.join(["python", os.path.relpath(__file__, REPO), *sys.argv[1:]])
        with open(args.json, "a") as f:
            for r in runs:
                row = {k: v for k, v in r.items() if k != "trace"}
                f.write(json.dumps({**about, **row}) + "\n")


if __name__ == "__main__":
    main()
