"""The report's views of the on-policy results: sampled vs scored vs trainer logprobs
(``onpolicy-<card>.json``), what path invariance costs offline
(``offline-path-invariance-<card>.json``) and the RL loop at a real shape
(``rl-loop-<card>.json``). ``experiments.report`` renders them into the README."""

from __future__ import annotations

from collections.abc import Callable

from experiments.report import _fmt, _source, _table

CARDS = ("h100", "h200")


def onpolicy_block(head: dict, records: list[dict], name: str) -> str:
    """One row per (model, mode): of the sampled tokens, how many have the bits of their
    re-score and of the trainer forward; the requests whose fingerprints agree; the gap."""
    rows = []
    for r in records:
        model = r["model"] if r.get("layers") in (None, 36, 48) else \
            f"{r['model']} ({r['layers']} layers)"
        rows.append([
            model, r["mode"], r["generated_tokens"], r["scored_equal"],
            r.get("top_logprobs_equal", "—"),
            f"{r['fingerprints_equal']} of {r['requests']}",
            r.get("trainer_equal", "—"), f"{r['max_abs_diff']:.3g}",
            _fmt(r["generate_s"], 1), _fmt(r["score_s"], 1)])
    runs = head.get("runs") or []
    commands = "; ".join(f"`{run['command']}` ({', '.join(run['models'])}, commit "
                         f"{run['git_commit'][:7]})" for run in runs)
    source = _source(head, name) if not runs else (
        f"_{head.get('machine', '?')}, torch {head.get('torch', '?')}, triton "
        f"{head.get('triton', '?')}; `experiments/results/{name}.json`, commands {commands}_")
    return source + "\n\n" + _table(
        ["model", "mode", "sampled tokens", "scored: same bits", "top-5 same bits",
         "fingerprints equal", "trainer: same bits", "max abs diff (nats)", "generate s",
         "score s"], rows)


def path_cost_block(head: dict, records: list[dict], name: str) -> str:
    """Each mode with and without path invariance, same workload, same card and call."""
    by_mode = {}
    for r in records:
        by_mode.setdefault(r["engine_mode"], {})[r["config"].get("path_invariant") is False] = r
    rows = []
    for mode, pair in by_mode.items():
        on, off = pair.get(False), pair.get(True)
        if on is None or off is None:
            continue
        rows.append([mode, _fmt(on["output_tok_s"], 1), _fmt(off["output_tok_s"], 1),
                     _fmt(on["output_tok_s"] / off["output_tok_s"], 3),
                     _fmt(on["decode_step_ms_p50"], 2), _fmt(off["decode_step_ms_p50"], 2),
                     _fmt(on["prefill_step_ms_p50"], 1), _fmt(off["prefill_step_ms_p50"], 1)])
    return _source(head, name) + "\n\n" + _table(
        ["mode", "output tok/s, path-invariant", "output tok/s, without", "ratio",
         "decode step p50 ms", "without", "prefill step p50 ms", "without"], rows)


def rl_loop_block(head: dict, records: list[dict], name: str) -> str:
    config = head.get("config", {})
    rows = [[r["iteration"], r["sampled_tokens"], _fmt(r["rollout_s"], 2),
             _fmt(r["rollout_tok_s"], 0), _fmt(r["train_s"], 2), _fmt(r["weight_sync_s"], 3),
             r["ratios_exactly_one"]] for r in records]
    what = (f"{config.get('model', '?')}, {config.get('prompts', '?')} prompts x n = "
            f"{config.get('n', '?')}, {config.get('max_tokens', '?')} tokens each")
    return _source(head, name) + f"\n\n{what}\n\n" + _table(
        ["iteration", "sampled tokens", "rollout s", "rollout tok/s", "train step s",
         "weight sync s", "ratios all exactly 1.0"], rows)


VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    **{f"onpolicy-{card}": (lambda h, r, n=f"onpolicy-{card}": onpolicy_block(h, r, n))
       for card in CARDS},
    **{f"offline-path-invariance-{card}":
       (lambda h, r, n=f"offline-path-invariance-{card}": path_cost_block(h, r, n))
       for card in CARDS},
    **{f"rl-loop-{card}": (lambda h, r, n=f"rl-loop-{card}": rl_loop_block(h, r, n))
       for card in CARDS},
}
