"""README views of what the device runs check rather than time: each driver stage's native pytest
run (``native_tests.py``), what ptxas reports for the kernels compiled offline for sm_90a
(``ptxas_report.py``), and each launcher's host cost beside its GPU time (``bench_launch_cost.py``).
Looked up by ``experiments.report``."""

from __future__ import annotations

from collections.abc import Callable

from experiments.report import _fmt, _source, _table


def ptxas_block(name: str) -> Callable[[dict, list[dict]], str]:
    """experiments/ptxas_report.py: per launch, what ptxas reports for sm_90a (compiled offline)."""

    def render(head: dict, records: list[dict]) -> str:
        # files written before the deferred-wait count keep their columns
        waits = any("wgmma_deferred_waits" in r for r in records)
        rows = [[r["case"], r.get("kernel", ""), _fmt(r.get("registers")),
                 _fmt(r.get("spill_store_bytes")), _fmt(r.get("spill_load_bytes")),
                 _fmt(r.get("shared_bytes")), "yes" if r.get("fits_shared") else "no",
                 _fmt(r.get("wgmma"))]
                + ([_fmt(r.get("wgmma_deferred_waits"))] if waits else [])
                + [_fmt(r.get("cp_async")), _fmt(r.get("tma_loads")), r.get("error", "")]
                for r in records]
        header = (["launch", "kernel", "registers", "spill stores (B)", "spill loads (B)",
                   "shared (B)", "fits", "wgmma"] + (["wgmma waits leaving one in flight"]
                                                     if waits else [])
                  + ["cp.async", "TMA loads", "error"])
        return "\n".join([
            _source(head, name), "", f"ptxas {head.get('ptxas', '?')}; {head.get('shape', '')}; "
            f"shared memory limit {head.get('shared_limit_bytes', '?')} bytes a block.", "",
            _table(header, rows),
        ])

    return render


def native_tests_block(name: str) -> Callable[[dict, list[dict]], str]:
    """experiments/native_tests.py: each driver stage's latest native pytest run."""
    return lambda head, records: _native_tests_table(name, head, records)


def _native_tests_table(name: str, head: dict, records: list[dict]) -> str:
    rows = [[r["stage"], r.get("date", "?"), r["tests"], r["passed"], r["failed"], r["errors"],
             r["skipped"], ", ".join(f"`{t}`" for t in r.get("failed_ids", []) + r.get(
                 "error_ids", [])) or "—"] for r in records]
    commands = "; ".join(f"{r['stage']}: `{r['command']}`" for r in records)
    return "\n".join([
        _source(head, name), "", f"pytest commands: {commands}.", "",
        _table(["stage", "date", "tests", "passed", "failed", "errors", "skipped",
                "failed or erroring tests"], rows),
    ])


def launch_cost_block(head: dict, records: list[dict]) -> str:
    """Per op and shape: the launcher's host cost (stubbed kernels on the CPU tensors, and real
    launches) beside the op's GPU time at the same shape."""
    by_op: dict[tuple, dict] = {}
    for r in records:
        if "shape" in r and "host_us" in r:
            by_op.setdefault((r["op"], r["shape"]), {})[r["mode"]] = r
    rows = []
    for (op, shape), modes in by_op.items():
        native = modes.get("native", {})
        rows.append([op, shape, _fmt(modes.get("stub", {}).get("host_us"), 1),
                     _fmt(native.get("host_us"), 1), _fmt(native.get("gpu_us"), 1),
                     _fmt(native.get("host_over_gpu"))])
    forward = [f"{r['mode']}: {r['host_us'] / 1000:.2f} ms" for r in records
               if r.get("op", "").startswith("qwen3-8b eager")]
    return (_source(head, "launch-cost-h200") + "\n\n" + f"Timing: {head.get('timing', '?')}.\n\n"
            + _table(["op", "shape", "host us (stub)", "host us (native)", "GPU us",
                      "host / GPU"], rows)
            + ("\n\nLaunch work of one eager Qwen3-8B decode forward (estimate, "
               + ", ".join(forward) + ")." if forward else ""))


VIEWS: dict[str, Callable[[dict, list[dict]], str]] = {
    "launch-cost-h200": launch_cost_block,
    **{name: native_tests_block(name) for name in ("native-tests-h200", "native-tests-h100")},
    **{f"ptxas-{target}-sm90": ptxas_block(f"ptxas-{target}-sm90")
       for target in ("mla-decode", "mla-prefill", "moe-align", "gemm", "gemm-tail",
                      "decode-attention")},
}
