"""benchmark/offline/ab.py: its variants, and an alternating CPU run of two of them."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))

from ab import Variant, main, parse_variant, summary  # noqa: E402

# each bench.py run as small as it gets (one request of 100 tokens, no warm-up: nothing compiles
# on a CPU): what is tested is how ab.py runs and records them, not their figures
TINY = ["--tiny", "--device", "cpu", "--single", "--max-output-len", "100", "--warmup", "0"]


def test_a_variant_names_its_tree_environment_and_arguments():
    v = parse_variant("new=tree:abc123;env:OMP_NUM_THREADS=1;args:--max-num-batched-tokens 16384")
    assert (v.label, v.tree, v.env) == ("new", "abc123", {"OMP_NUM_THREADS": "1"})
    assert v.args == ["--max-num-batched-tokens", "16384"]
    assert parse_variant("plain") == Variant("plain")


@pytest.mark.parametrize(
    "text, says",
    [
        ("=tree:x", "no label"),
        ("a=tree", "KIND:VALUE"),
        ("a=env:X", "NAME=VALUE"),
        ("a=gpu:1", "unknown"),
    ],
)
def test_a_malformed_variant_is_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=says):
        parse_variant(text)


def test_the_summary_gives_each_mean_against_the_first():
    a, b = Variant("a", tok_s=[100.0, 102.0]), Variant("b", tok_s=[103.0, 105.0])
    lines = summary([a, b])
    assert lines[0].endswith("mean 101.0 tok/s  +0.00%") and lines[1].endswith("+2.97%")


def run_ab(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "offline", "ab.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_variants_alternate_each_in_its_tree_and_environment(tmp_path):
    tree = tmp_path / "python"
    shutil.copytree(os.path.join(ROOT, "python", "minisgl"), tree / "minisgl")
    out = tmp_path / "ab.jsonl"
    spec = f"copy=tree:{tree};env:MINISGL_AB_TEST=1;args:--repeat 2"
    proc = run_ab("--variant", "here", "--variant", spec, "--json", str(out), "--", *TINY)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["note"] for line in lines] == [
        "ab here round 1",
        "ab copy round 1",
        "ab here round 2",
        "ab copy round 2",
    ]
    here, copy = lines[0], lines[1]
    assert copy["commit"] is None and len(copy["runs_s"]) == 2  # a folder's commit is unknown
    assert copy["command"].startswith("MINISGL_AB_TEST=1 python benchmark/offline/bench.py --tiny")
    assert copy["command"].endswith(f"--repeat 2 --json {out} --note 'ab copy round 1'")
    assert here["command"].startswith("python benchmark/offline/bench.py --tiny")
    assert "copy  " in proc.stdout and "mean" in proc.stdout


def test_a_broken_tree_stops_the_run_naming_the_variant(tmp_path):
    tree = tmp_path / "python" / "minisgl"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("raise ImportError('the broken tree')\n")
    proc = run_ab("--variant", f"broken=tree:{tree.parent}", "--variant", "here", "--", *TINY)
    assert proc.returncode != 0 and "broken: bench.py failed" in proc.stderr
    assert "the broken tree" in proc.stderr


def test_a_label_given_twice_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="a label given twice"):
        main(["--variant", "a", "--variant", "a=env:X=1", "--", *TINY])
