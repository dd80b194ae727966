"""Analytics answers (docs/protocol.md, "Analytics answers"): the same bytes as the Rust device
library for the same records, and the policy's `analytics=` line read strictly. Needs no server."""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from confed_client import analytics
from confed_client.policy import PolicyError, parse_policy

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "tests" / "vectors" / "analytics_answers.json"


@pytest.mark.parametrize("case", json.loads(VECTORS.read_text()),
                         ids=lambda case: case["query"]["query"])
def test_answers_are_byte_for_byte_the_rust_librarys(case):
    query = analytics.parse_query(analytics.encode_query(case["query"]))
    records = case["records"]
    if query["query"] == "histogram":
        records = [tuple(r) for r in records]
    assert analytics.answer(query, records).hex() == case["answer_hex"]


def test_every_answer_of_a_query_has_the_same_size():
    query = {"query": "open_histogram", "max_key_bytes": 16, "keys_per_device": 8}
    sizes = {len(analytics.answer(query, words, rng=random.Random(1)))
             for words in ([], ["a"], [f"w{i}" for i in range(100)], ["é" * 40])}
    sizes.add(len(analytics.failed_answer(query)))
    assert len(sizes) == 1


def test_a_device_with_more_words_than_the_bound_sends_a_uniform_choice():
    query = {"query": "open_histogram", "max_key_bytes": 4, "keys_per_device": 1}
    rng = random.Random(7)
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(6000):
        data = analytics.answer(query, ["a", "b", "b", "c"], rng=rng)
        from safetensors.numpy import load
        key = bytes(load(data)[analytics.KEYS_TENSOR][0]).rstrip(b"\0").decode()
        counts[key] += 1
    assert all(abs(n / 6000 - 1 / 3) < 0.03 for n in counts.values()), counts


def test_the_policy_line_parses_strictly():
    line = "open_histogram;max_key_bytes=32;keys_per_device=16"
    assert analytics.encode_query(analytics.parse_query(line)) == line
    quantiles = "quantiles;min=0e0;max=3.6e3;ranks=5e-1,9.9e-1;values_per_device=1"
    assert analytics.parse_query(quantiles)["ranks"] == [0.5, 0.99]
    for bad in ("open_histogram;keys_per_device=16;max_key_bytes=32",
                "open_histogram;max_key_bytes=65;keys_per_device=16",
                "histogram;domain_size=010;keys_per_device=1;max_value=1",
                "quantiles;min=0e0;max=3600;ranks=5e-1;values_per_device=1",
                "sql;select=1"):
        with pytest.raises(PolicyError):
            analytics.parse_query(bad)
    policy = ("confed-task-policy/v3\ntask_id=t\ntenant_id=n\npopulation=p\nrounds=1\n"
              "report_goal=1\nmin_reports=1\nepsilon=1e0\ndelta=1e-6\nclip_norm=1e0\n"
              "mechanism=discrete_gaussian_on_grid\nserver_learning_rate=1e0\nplan={}\n"
              f"upload_window=0,0\nanalytics={line}\n")
    assert parse_policy(policy)["analytics"]["keys_per_device"] == 16
    assert parse_policy(policy.replace(f"analytics={line}\n", ""))["analytics"] is None
