"""``bench.served_throughput``'s view from the engine: its latency series read from a real
served engine's /metrics around a load, with counts that must come out exact."""

from __future__ import annotations

from bench.served_throughput import _server_means, _server_series
from tests.engine.served_engine import MODEL, Served


def test_the_engines_means_come_from_its_own_series_between_two_scrapes():
    """Three requests of known sizes, one at a time (no batching): the engine computed every
    prompt token and every output token but the last of each, so tokens per step times steps
    is that total; its TTFT is its queue plus its prefill."""
    served = Served(1)
    try:
        before = _server_series(served.url)
        prompts, outputs = [[5] * 7, [9] * 3, [2] * 12], [4, 6, 2]
        for prompt, output in zip(prompts, outputs):
            done = served.client().completions.create(model=MODEL, prompt=prompt, max_tokens=output,
                                                      temperature=0, extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == output
        after = _server_series(served.url)
    finally:
        assert served.close() == 0
    assert after["ttft"][1] - before["ttft"][1] == 3
    means = _server_means(before, after, window_s=2.0)
    steps = after["step"][1] - before["step"][1]
    assert means["steps_per_s"] == steps / 2.0
    assert round(means["step_tokens"] * steps) == sum(map(len, prompts)) + sum(o - 1 for o in outputs)
    assert abs(means["queue_mean_ms"] + means["prefill_mean_ms"] - means["ttft_mean_ms"]) <= 0.015
    assert means["ttft_mean_ms"] > 0
    assert means["step_mean_ms"] > 0
