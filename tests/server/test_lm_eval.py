"""A real evaluation client: EleutherAI's lm-evaluation-harness scores a small local
multiple-choice task on the same tiny checkpoint — through a minisgl server
(`local-completions`: batched token-id prompts, `echo` + `logprobs`, `max_tokens` 1; once with
the tokenizer's files, once with `tokenizer_backend=remote`: /tokenizer_info, /tokenize and
/detokenize) and with transformers in-process (`hf`, float32 on the CPU) — and every choice's
loglikelihood agrees."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support.server import make_tiny_model, run_server

lm_eval = pytest.importorskip("lm_eval")  # a dev dependency; absent on the GPU machines
from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASK = "minisgl_tiny_mc"
BATCH_SIZE = 4
TOLERANCE = 1e-3
# words the tiny tokenizer was trained on (support/tokenizer.py), so prompts are several tokens
QUESTIONS = [
    ("the quick brown fox", ["jumps over", "runs", "the lazy dog", "decode"]),
    ("hello world, the model", ["answer", "token cache", "prefill batch"]),
    ("a small fast server", ["stream", "request", "page prefix radix", "café"]),
    ("the cat runs", ["over the dog", "fast", "question"]),
    ("你好 世界", ["模型", "缓存 请求", "今天 天气 很好"]),
    ("crème brûlée", ["naïve", "résumé über", "straße", "🚀"]),
    ("the radix cache", ["hits", "a prefix page", "🔥 🤖"]),
    ("quick question:", ["answer", "small batch decode", "señor jalapeño"]),
]


def write_task(directory: Path) -> None:
    """The JSONL questions and the task YAML that points at them (lm-eval's include_path)."""
    data = directory / "questions.jsonl"
    docs = [
        {"question": q, "choices": choices, "answer": i % len(choices)}
        for i, (q, choices) in enumerate(QUESTIONS)
    ]
    data.write_text("".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs))
    yaml = f"""
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(directory / "datasets-cache"))}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    (directory / f"{TASK}.yaml").write_text(yaml)


def loglikelihoods(
    model: str | LocalCompletionsAPI, model_args: dict[str, Any] | None, directory: Path
) -> dict[tuple[int, int], float]:
    """(document, choice) -> lm-eval's loglikelihood of the choice after the question."""
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(directory), include_defaults=False),
        batch_size=BATCH_SIZE,
        log_samples=True,
    )
    assert results is not None
    out = {}
    for sample in results["samples"][TASK]:
        for choice, [(loglikelihood, _greedy)] in enumerate(sample["resps"]):
            out[sample["doc_id"], choice] = loglikelihood
    return out


def served_loglikelihoods(
    model_dir: str, url: str, directory: Path, remote: bool = False
) -> tuple[dict[tuple[int, int], float], list[dict[str, Any]]]:
    """`loglikelihoods` through the server, and the request bodies lm-eval sent; `remote`: with
    the server's tokenizer (/tokenizer_info, /tokenize, /detokenize), no tokenizer files."""
    client = LocalCompletionsAPI(
        model=model_dir,
        base_url=f"{url}/v1/completions",
        tokenizer=None if remote else model_dir,
        tokenizer_backend="remote" if remote else "huggingface",
        tokenized_requests=True,
        batch_size=BATCH_SIZE,
    )
    payloads: list[dict[str, Any]] = []
    create_payload = client._create_payload

    def record(*args: Any, **kwargs: Any) -> dict[str, Any]:
        payloads.append(create_payload(*args, **kwargs))
        return payloads[-1]

    client._create_payload = record  # type: ignore[method-assign]
    return loglikelihoods(client, None, directory), payloads


def test_lm_eval_through_the_server_matches_transformers(tmp_path: Path) -> None:
    model_dir, log = make_tiny_model(str(tmp_path / "tiny-qwen3")), str(tmp_path / "server.log")
    write_task(tmp_path)
    hf_args = {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}
    # transformers' run while the server starts (the start is most of this test's time)
    with ThreadPoolExecutor(1) as pool:
        expected_later = pool.submit(loglikelihoods, "hf", hf_args, tmp_path)
        with run_server(model_dir, log_path=log) as server:
            expected = expected_later.result()
            served, payloads = served_loglikelihoods(model_dir, server.url, tmp_path)
            remote, _ = served_loglikelihoods(model_dir, server.url, tmp_path, remote=True)

    assert len(expected) == sum(len(choices) for _, choices in QUESTIONS)
    # what lm-eval sends for loglikelihoods: batches of token-id prompts, scored with echo
    assert max(len(p["prompt"]) for p in payloads) == BATCH_SIZE
    for p in payloads:
        assert (p["echo"], p["logprobs"], p["max_tokens"], p["temperature"]) == (True, 1, 1, 0)
        assert all(
            isinstance(ids, list) and all(type(t) is int for t in ids) for ids in p["prompt"]
        )
    assert served.keys() == expected.keys()
    worst = max(abs(served[k] - expected[k]) for k in expected)
    assert worst <= TOLERANCE, {k: (served[k], expected[k]) for k in expected}
    # lm-eval's remote tokenizer: the same scores, with no tokenizer files nor hub on its side
    assert remote.keys() == expected.keys()
    worst = max(abs(remote[k] - expected[k]) for k in expected)
    assert worst <= TOLERANCE, {k: (remote[k], expected[k]) for k in expected}
