"""The README's "At a glance": is CoRun deterministic, is it fast, against which peers, on which
card, with a token's bits the same on every path: one row per question, each computed from the
results file it names (``experiments.report`` renders it)."""

from __future__ import annotations

from experiments.report import _load, _table

PEERS = ("default", "batch_invariant_tuned", "batch_invariant")


def _card(head: dict) -> str:
    return head.get("machine", "?").replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _offline_rows(head: dict, records: list[dict], source: str) -> list[list[str]]:
    by_mode = {r["mode"]: r for r in records}
    corun = by_mode["corun"]
    audit = f"{corun['audit_requests']} rescheduled + {corun['alone_sample']} alone"
    deterministic = ", ".join(f"`{m}` {by_mode[m]['mismatches']}" for m in
                              ("corun", "batch_invariant_tuned", "batch_invariant", "default"))
    speed = ", ".join(f"{corun['output_tok_s'] / by_mode[m]['output_tok_s']:.2f}x `{m}`"
                      for m in PEERS)
    return [
        ["same bits whatever runs beside a request? (fingerprint mismatches, " + audit + ")",
         deterministic, _card(head), source],
        [f"offline throughput (Qwen3-8B shape, {corun['requests']} requests, path invariance "
         "off)",
         f"`corun` {corun['output_tok_s']:.0f} output tok/s: {speed}", _card(head), source]]


def _serving_row(head: dict, records: list[dict], source: str) -> list[list[str]]:
    at64 = {r["label"]: r["output_throughput"] for r in records
            if r.get("max_concurrency") == 64}
    if "corun" not in at64:
        return []
    ratios = ", ".join(f"{at64['corun'] / at64[m]:.2f}x `{m}`" for m in PEERS[:2] if m in at64)
    return [["serving at concurrency 64 (peers' small steps from CUDA graphs; path invariance off)",
             f"`corun` {at64['corun']:.0f} output tok/s: {ratios}", _card(head),
             source]]


def _onpolicy_row(head: dict, records: list[dict], source: str) -> list[list[str]]:
    deterministic = [r for r in records if r["mode"] != "default"]
    equal = sum(r["scored_equal"] for r in deterministic)
    total = sum(r["generated_tokens"] for r in deterministic)
    trained = [r for r in deterministic if r.get("trainer_equal") is not None]
    trainer = (f"; trainer forward {sum(r['trainer_equal'] for r in trained)} of "
               f"{sum(r['generated_tokens'] for r in trained)} "
               f"({', '.join(sorted({r['model'] for r in trained}))})") if trained else ""
    default = [r for r in records if r["mode"] == "default"]
    control = (f"; `default` {sum(r['scored_equal'] for r in default)} of "
               f"{sum(r['generated_tokens'] for r in default)}") if default else ""
    families = sorted({r["model"] for r in deterministic})
    return [[f"a sampled token's logprob = its re-score's ({len(families)} families, the "
             f"deterministic modes)", f"{equal} of {total} tokens bit-identical{trainer}{control}",
             _card(head), source]]


def _path_cost_row(head: dict, records: list[dict], source: str) -> list[list[str]]:
    pairs: dict[str, dict[bool, dict]] = {}
    for r in records:
        pairs.setdefault(r["engine_mode"], {})[r["config"].get("path_invariant") is not False] = r
    ratios = [f"`{mode}` {pair[True]['output_tok_s'] / pair[False]['output_tok_s']:.2f}x"
              for mode, pair in pairs.items() if True in pair and False in pair]
    if not ratios:
        return []
    return [["what path invariance costs (output tok/s with it / without it, same call)",
             ", ".join(ratios), _card(head),
             source]]


def _paper_row(head: dict, records: list[dict], source: str) -> list[list[str]]:
    gains = []
    for model in sorted({r["model"] for r in records}):
        modes = {r["mode"]: r for r in records if r["model"] == model}
        if "corun" in modes and "batch_invariant" in modes:
            gains.append(modes["corun"]["output_tok_s"] / modes["batch_invariant"]["output_tok_s"])
    if not gains:
        return []
    mean = sum(gains) / len(gains)
    return [["the paper's claim: throughput vs batch-invariant kernels (paper: +15% to +324%)",
             f"+{(mean - 1) * 100:.1f}% mean over {len(gains)} families "
             f"({min(gains):.2f}x-{max(gains):.2f}x)", _card(head),
             source]]


# Each row's results file and the function that reads it.
ROWS = (("offline-h200", _offline_rows), ("serving-peer-graphs-h200", _serving_row),
        ("onpolicy-h100", _onpolicy_row), ("offline-path-invariance-h100", _path_cost_row),
        ("paper-h200", _paper_row))


def glance_block(head: dict, records: list[dict]) -> str:
    rows = []
    for name, row in ROWS:
        loaded = _load(name)
        if loaded is not None:
            rows += row(*loaded, f"`experiments/results/{name}.json`")
    return _table(["question", "measured", "card", "file"], rows)


VIEWS = {"at-a-glance": glance_block}
# The view reads its own files; the block's name maps to one that exists, so it renders.
ALIASES = {"at-a-glance": "offline-h200"}
