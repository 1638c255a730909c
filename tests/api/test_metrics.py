"""The token counters a test or a dashboard compares before and after are exported at 0 from the
first scrape, before any request has finished (a labelled Prometheus counter otherwise has no
sample until its label is first used)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from corun.api.metrics import ServerMetrics


def test_token_counters_are_exported_at_zero_before_any_request():
    text = ServerMetrics("m").render().decode()
    samples = {s.name: s for family in text_string_to_metric_families(text)
               for s in family.samples}
    for name in ("corun:prompt_tokens_total", "corun:generation_tokens_total",
                 "corun:prefix_cache_queries_total", "corun:prefix_cache_hits_total",
                 "corun:engine_step_tokens_sum"):
        assert samples[name].value == 0.0 and samples[name].labels == {"model_name": "m"}, name
    steps = [s for family in text_string_to_metric_families(text) for s in family.samples
             if s.name in ("corun:engine_steps_total", "corun:engine_step_seconds_count")]
    assert sorted((s.name, s.labels["kind"], s.value) for s in steps) == sorted(
        (name, kind, 0.0) for name in ("corun:engine_steps_total",
                                       "corun:engine_step_seconds_count")
        for kind in ("prefill", "decode", "combined"))
