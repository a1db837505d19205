"""A/B runs of bench.py, alternating: each round runs every variant once, in the order given,
each in its own process (on the lent GPUs the spread between processes, 1-4 %, is larger than
within one: docs/benchmarks.md, sessions 31 and 33), then prints each variant's figures, their
mean and the change against the first variant.

    python benchmark/offline/ab.py --variant base=tree:9177bb5 --variant new -- \\
        --config benchmark/qwen3-0.6b                       # another commit's package against this
    python benchmark/offline/ab.py --variant default --variant one-thread=env:OMP_NUM_THREADS=1 \\
        --rounds 3 --json benchmark/results.jsonl --note "session 34" -- --config benchmark/qwen3-0.6b
    python benchmark/offline/ab.py --variant 8k --variant "16k=args:--max-num-batched-tokens 16384" \\
        -- --tiny --device cpu --num-seqs 4 --max-input-len 128 --max-output-len 100    # smoke run

A variant is LABEL[=PART[;PART...]], each PART one of
  tree:COMMIT | tree:DIR  the minisgl package of that commit (`git archive` of its python/ into a
                          temporary folder) or of that python/ folder, first on PYTHONPATH;
  env:NAME=VALUE          an environment variable of its processes;
  args:ARGS               more bench.py arguments (split as a shell would).
The arguments after `--` go to every run. With --json each run's bench.py line is appended there,
its note "NOTE LABEL round I", its command with the variant's environment in front and its
commit the tree that ran (bench.py itself names this checkout's)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmark", "offline", "bench.py")


@dataclass
class Variant:
    label: str
    tree: str | None = None  # a python/ folder to import minisgl from; None: this checkout's
    commit: str | None = None  # the commit that tree came from (None: a folder's, unknown)
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    """LABEL[=PART[;PART...]] -> a Variant whose tree, if a commit, is not yet exported."""
    label, _, spec = text.partition("=")
    if not label:
        raise ValueError(f"--variant {text!r}: no label before '='")
    variant = Variant(label)
    for part in filter(None, spec.split(";")):
        kind, sep, value = part.partition(":")
        if not sep or not value:
            raise ValueError(f"--variant {text!r}: {part!r} is not KIND:VALUE")
        if kind == "tree":
            variant.tree = value
        elif kind == "env":
            name, eq, env_value = value.partition("=")
            if not eq or not name:
                raise ValueError(f"--variant {text!r}: env:{value} is not NAME=VALUE")
            variant.env[name] = env_value
        elif kind == "args":
            variant.args += shlex.split(value)
        else:
            raise ValueError(f"--variant {text!r}: unknown part {kind!r} (tree, env or args)")
    return variant


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, check=True)


def resolve_tree(variant: Variant, workdir: str) -> None:
    """A tree that is a folder stays one; a commit's python/ is exported under `workdir`."""
    if variant.tree is None:
        return
    if os.path.isdir(variant.tree):
        variant.tree = os.path.abspath(variant.tree)
        return
    try:
        commit = git("rev-parse", "--short", variant.tree).stdout.decode().strip()
        archive = git("archive", "--format=tar", commit, "python").stdout
    except subprocess.CalledProcessError as e:
        raise ValueError(f"tree:{variant.tree}: neither a folder nor a commit here") from e
    dest = os.path.join(workdir, variant.label)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    variant.tree, variant.commit = os.path.join(dest, "python"), commit


def run_once(
    variant: Variant, bench_args: list[str], note: str, workdir: str, json_path: str | None
) -> dict:
    """One bench.py process of `variant`; its JSON line, whose command names the variant's
    environment and `json_path` (what re-runs it alone) and whose commit is the tree's."""
    out = os.path.join(workdir, "line.json")
    if os.path.exists(out):
        os.remove(out)
    path = [variant.tree] if variant.tree else []
    path += [os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, **variant.env, PYTHONPATH=os.pathsep.join(filter(None, path)))
    cmd = [sys.executable, BENCH, *bench_args, *variant.args, "--json", out, "--note", note]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{variant.label}: bench.py failed\n{proc.stderr[-3000:]}")
    with open(out) as f:
        line = json.loads(f.readline())
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in variant.env.items())
    ran, kept = (shlex.join(["--json", where, "--note", note]) for where in (out, json_path or ""))
    line["command"] = prefix + line["command"].replace(ran, kept if json_path else "").rstrip()
    if variant.tree is not None:  # bench.py named this checkout's; a folder's is unknown
        line["commit"] = variant.commit
    return line


def summary(variants: list[Variant]) -> list[str]:
    """A line per variant: its figures, their mean and the change of the mean against the first's."""
    base = statistics.fmean(variants[0].tok_s)
    width = max(len(v.label) for v in variants)
    lines = []
    for v in variants:
        mean = statistics.fmean(v.tok_s)
        runs = " · ".join(f"{x:,.1f}" for x in v.tok_s)
        lines.append(f"{v.label:<{width}}  {runs}  mean {mean:,.1f} tok/s  {mean / base - 1:+.2%}")
    return lines


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variant", action="append", required=True, help="LABEL[=PART[;PART...]]")
    p.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    p.add_argument("--json", help="append every run's JSON line to this file")
    p.add_argument("--note", default="ab", help="the runs' note: NOTE LABEL round I")
    args = p.parse_args(own)
    if len(args.variant) < 2 or args.rounds < 1:
        p.error("--variant needs two or more variants and --rounds at least 1")
    return args, bench_args


def main(argv: list[str]) -> None:
    args, bench_args = parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
        labels = [v.label for v in variants]
        if len(set(labels)) < len(labels):
            raise ValueError(f"--variant: a label given twice in {labels}")
        with tempfile.TemporaryDirectory(prefix="minisgl_ab_") as workdir:
            for v in variants:
                resolve_tree(v, workdir)
            run_rounds(variants, args, bench_args, workdir)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(str(e)) from None
    print("\n".join(summary(variants)))


def run_rounds(
    variants: list[Variant], args: argparse.Namespace, bench_args: list[str], workdir: str
) -> None:
    """--rounds rounds of every variant in order; each run's figure kept, its line appended."""
    for i in range(1, args.rounds + 1):
        for v in variants:
            note = f"{args.note} {v.label} round {i}"
            line = run_once(v, bench_args, note, workdir, args.json)
            v.tok_s.append(line["tok_s"])
            print(f"round {i} {v.label}: {line['tok_s']:,.1f} tok/s", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
