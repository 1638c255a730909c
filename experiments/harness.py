"""Shared benchmark harness: do_bench medians, memory-bound figures, records with a header.

Every figure CoRun publishes comes through here: timed with ``triton.testing.do_bench`` (median,
after warm-up, CUDA events), compared with its peer *in the same run* as a ratio, and written to
``experiments/results/<name>.json`` as a list whose first record is the header (machine, torch and
triton versions, date, the exact command).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import triton

from kernels.utils import card_name

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Measured device-to-device copy bandwidth, bytes read and written (the device tool's KINDS.md):
# the H200's 4.3 TB/s (2026-10-28 and 2026-11-04), the denominator the issues name; the H100's
# 3.0 TB/s (2026-11-13). A bound is computed at the bandwidth of the card that was timed.
H200_BANDWIDTH_BYTES_PER_S = 4.3e12
COPY_BANDWIDTH_BYTES_PER_S = {"h200": H200_BANDWIDTH_BYTES_PER_S, "h100": 3.0e12}
# Measured bf16 matmul rates, an 8192^3 product on random data (the device tool's KINDS.md: the
# H200 2026-10-28, the H100 2026-11-13), the compute floors' rate.
MATMUL_FLOPS_PER_S = {"h200": 790e12, "h100": 798e12}
# The vendors' datasheet peaks, which a stream that mostly reads can pass the copy rate towards.
DATASHEET_BANDWIDTH_BYTES_PER_S = {"h200": 4.8e12, "h100": 3.35e12}


def card_tag() -> str:
    """The card results are named after (``native-tests-h100``): ``h200`` / ``h100`` for those
    NVIDIA cards, another GPU's name in lower case with dashes, else this CPU's architecture.
    Files keep their card's name so that one card's figures never merge into another's."""
    if torch.cuda.is_available():
        return card_name(torch.cuda.get_device_name())
    return (platform.machine() or "cpu").lower()


# Prompt lengths of the benchmarks' warm-up single requests: the GEMM policies' M buckets, each
# also one token short. Triton compiles a kernel again for an int argument that is (or is not)
# divisible by 16, and the dynamic modes' mixed steps reach both kinds: on the H200 their timed
# runs still compiled 2-10 kernels when the warm-up sent the bucket lengths alone.
GEMM_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
WARMUP_LENGTHS = tuple(sorted({n for bucket in GEMM_BUCKETS for n in (bucket, bucket - 1) if n}))


def _warm_up(fn: Callable[[], object], warmup_ms: float) -> None:
    """Run ``fn`` back to back for about ``warmup_ms``, then wait for the card. The count comes
    from one timed call (events: the card's time, or the launch's where the host is slower), so
    a long kernel is not queued a host loop's worth of times."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(1, min(1000, int(warmup_ms / max(start.elapsed_time(end), 1e-3))))
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()


def bench_us(
    fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100, cuda_graph: bool = True
) -> float:
    """Median time of ``fn`` in microseconds.

    By default ``fn`` runs back to back for ``warmup_ms``, is then captured in a CUDA graph and
    the replays are timed (``triton.testing.do_bench_cudagraph``): the engine runs decode under
    graphs, and for small shapes an eager launch measures Python launch overhead rather than the
    kernel (METHOD.md). Ours and the peer are timed the same way. A function that cannot be
    captured (it syncs with the host) falls back to ``do_bench`` (CUDA events, L2 flushed
    between runs). Graph replays do not flush L2, so operands that fit in the H200's 50 MB L2
    are partly read from cache.
    """
    import triton.testing

    if cuda_graph and torch.cuda.is_available():
        try:
            fn()  # compile and allocate outside the capture
            torch.cuda.synchronize()
            # do_bench_cudagraph runs fn six times before it captures: after a compile left the
            # card idle for seconds, that is no warm-up (METHOD.md: warm up first).
            _warm_up(fn, warmup_ms)
            ms = triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
            return float(ms) * 1e3
        except Exception as err:  # not capturable: a host sync inside fn
            torch.cuda.synchronize()
            # Said aloud: do_bench flushes L2 and times the launch, so such a time is not
            # comparable with a graph-replayed peer's.
            print(f"bench_us: no CUDA graph ({type(err).__name__}: {str(err)[:160]}); "
                  f"timed with do_bench", file=sys.stderr)
    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3


def timed_rounds(first_pass: dict, finalists: list, rounds: int,
                 next_round: Callable[[], Callable[[object], float | None]]) -> dict:
    """Each finalist's first-pass time and ``rounds`` more: {finalist: [us, ...]}. The rounds are
    interleaved (every finalist once a round), so a card's drift over them touches all alike;
    ``next_round()`` gives each round's timer, after setting the round up (fresh operands, say).
    A finalist that fails a round (its timer returns None) is dropped."""
    samples = {finalist: [first_pass[finalist]] for finalist in finalists}
    for _ in range(rounds):
        time_one = next_round()
        for finalist in finalists:
            samples[finalist].append(time_one(finalist))
    return {finalist: us for finalist, us in samples.items() if None not in us}


@contextmanager
def count_jit_compiles() -> Iterator[list[str]]:
    """The Triton kernels compiled inside the block, one name per compile (Triton's
    ``jit_post_compile_hook``; the hook in place before is chained and restored). A compile in a
    timed window is time the run did not spend on the workload: the warm-up missed a shape. Under
    TRITON_INTERPRET nothing compiles, so the list stays empty."""
    import triton

    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook
    compiled: list[str] = []

    def hook(*args: object, **kwargs: object) -> object:
        compiled.append(str(kwargs.get("repr", "?")).split("[", 1)[0])
        return previous(*args, **kwargs) if previous else None

    runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        runtime.jit_post_compile_hook = previous


@contextmanager
def kernels_replaced(modules: list, stand_in: Callable[[object], object]) -> Iterator[list]:
    """Every Triton kernel object bound in ``modules`` replaced by ``stand_in(kernel)`` inside the
    block (the launchers then call the stand-in), and put back however the block ends; yields the
    kernels replaced."""
    from triton.runtime.jit import KernelInterface

    saved = [(module, name, value) for module in modules
             for name, value in list(vars(module).items()) if isinstance(value, KernelInterface)]
    try:
        for module, name, value in saved:
            setattr(module, name, stand_in(value))
        yield [value for _, _, value in saved]
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _measured_card() -> str:
    """The card whose measurements this machine's bounds use: this card, or the H200 where none
    was measured (the CPU's dry runs, another GPU)."""
    card = card_tag()
    return card if card in COPY_BANDWIDTH_BYTES_PER_S else "h200"


def bandwidth_card() -> str:
    """``_measured_card()`` as the headers record it, saying where it stands in for this one."""
    card = _measured_card()
    return card if card == card_tag() else f"{card} (none measured for this machine)"


def copy_bandwidth() -> float:
    """The measured copy bandwidth (bytes/s) of ``_measured_card()``."""
    return COPY_BANDWIDTH_BYTES_PER_S[_measured_card()]


def matmul_rate() -> float:
    """The measured bf16 matmul rate (FLOP/s) of ``_measured_card()``."""
    return MATMUL_FLOPS_PER_S[_measured_card()]


def bandwidth_label() -> str:
    """``4.3 TB/s``: how the bound strings name the bandwidth they assume."""
    return f"{copy_bandwidth() / 1e12:.1f} TB/s"


def memory_bound_us(num_bytes: float, bandwidth: float | None = None) -> float:
    """The time to move ``num_bytes`` once at the measured copy bandwidth of this card (or
    ``bandwidth``), in microseconds."""
    return num_bytes / (bandwidth or copy_bandwidth()) * 1e6


def copy_reference_us(num_bytes: int, **bench_kwargs: object) -> float:
    """The graph-replayed time of the vendor's device copy (``Tensor.copy_``, bf16) moving
    ``num_bytes``: half read, half written, timed as the kernels are (``bench_us``). A reference
    beside ``memory_bound_us``'s ideal, not a floor: a kernel that mostly reads can beat it. Where
    even the copy stays far from the bound (small shapes: launch and latency), the shape limits
    what one launch moving those bytes reaches. Needs CUDA."""
    elements = max(1, num_bytes // 4)
    src = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return bench_us(lambda: dst.copy_(src), **bench_kwargs)


@triton.jit
def _empty_kernel(unused_ptr):
    pass


def launch_floor_us(grids: list[tuple[int, ...]], num_warps: int = 4,
                    **bench_kwargs: object) -> float:
    """The graph-replayed time (``bench_us``) of an empty Triton kernel launched once per grid of
    ``grids``, in order, with ``num_warps`` warps a program: what a kernel sequence of those
    launches pays before it moves a byte (each launch's start and drain, every program scheduled,
    the wait of each launch on the one before). A kernel of those launches whose first launch
    reads B bytes takes at least about this plus B at the bound. Needs CUDA."""
    if not grids:
        raise ValueError("grids: expected at least one launch grid")
    anchor = torch.empty(1, device="cuda")

    def launches() -> None:
        for grid in grids:
            _empty_kernel[grid](anchor, num_warps=num_warps)

    return bench_us(launches, **bench_kwargs)


def git_commit() -> str | None:
    """The commit the results were made at: ``CORUN_GIT_COMMIT`` when set (a device runs a copy
    of the working tree whose .git, if any, is not the commit sent: the caller names it), else
    ``git rev-parse HEAD`` of this checkout."""
    import subprocess

    if os.environ.get("CORUN_GIT_COMMIT"):
        return os.environ["CORUN_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def header(command: str | None = None, **extra: object) -> dict:
    """The first record of every results file."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:  # platform.processor() is empty on some Linux machines
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "header": True,
        "machine": device,
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "git_commit": git_commit(),
        # the bandwidth every memory bound in the file assumes, and whose measurement it is
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "copy_bandwidth_card": bandwidth_card(),
        **extra,
    }


def write_results(
    name: str, records: list[dict], out_dir: Path | str | None = None, **extra
) -> Path:
    """Write ``[header, *records]`` to ``<out_dir or results>/<name>.json``; returns the path."""
    out = Path(out_dir or os.environ.get("CORUN_RESULTS_DIR", RESULTS_DIR))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps([header(**extra), *records], indent=1) + "\n")
    return path


GRAPH_REPLAY_TIMING = "harness.bench_us: CUDA-graph replay medians after a back-to-back warm-up"


def probe_main(probe: str, collect: Callable[[], list[dict]],
               timing: str = GRAPH_REPLAY_TIMING,
               header_extra: Callable[[], dict] | None = None) -> int:
    """The command line of a ``probe_<name>.py``: its records into
    ``<results>/probe-<name>-<card>.json`` (``probe`` with dashes); 2 without a GPU.
    ``header_extra``, called after ``collect``, adds what the run learned to the header (whether
    a budget cut it, say)."""
    if not torch.cuda.is_available():
        print(f"probe {probe} needs a CUDA device; none found", file=sys.stderr)
        return 2
    records = collect()
    path = write_results(f"probe-{probe}-{card_tag()}", records, timing=timing,
                         **(header_extra() if header_extra else {}))
    print(f"wrote {path}")
    return 0


def kernel_record(
    op: str,
    policy: str,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    us: float,
    peer: str,
    peer_us: float,
    **extra: object,
) -> dict:
    """One row of kernels-<card>.json; ratio = peer_us / us (higher is better for us)."""
    return {
        "op": op,
        "policy": policy,
        "M": m,
        "N": n,
        "K": k,
        "dtype": str(dtype).removeprefix("torch."),
        "us": round(us, 3),
        "peer": peer,
        "peer_us": round(peer_us, 3),
        "ratio": round(peer_us / us, 4) if us > 0 else None,
        **extra,
    }


def family_main(
    family: str,
    collect: Callable[..., list[dict]],
    check_invariance_gpu: Callable[[], list[dict]],
    argv: list[str] | None = None,
    description: str | None = None,
    summarize: Callable[[list[dict]], None] | None = None,
) -> int:
    """The command line of one ``bench_<family>.py``: timings and GPU invariance checks written to
    ``<family>-<card>.json`` (``bench_kernels.py`` runs every family into one file instead)."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a handful of shapes (smoke run)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"bench_{family}: needs a CUDA device (H200); nothing measured.", file=sys.stderr)
        return 2
    start = time.monotonic()
    records = collect(quick=args.quick)
    collect_s = time.monotonic() - start
    checks = check_invariance_gpu()
    for check in checks:
        if not check.get("passed"):
            print(f"FAIL {check.get('op')} {check.get('check')} {check.get('mode')}: "
                  f"{check.get('detail', '')}")
    path = write_results(f"{family}-{card_tag()}", records + checks, quick=args.quick,
                         collect_s=round(collect_s, 1))
    if summarize is not None:
        summarize(records)
    failed = sum(1 for c in checks if not c.get("passed"))
    print(f"wrote {path}: {len(records)} timings in {collect_s:.1f} s, {len(checks)} checks, "
          f"{failed} not as expected")
    return 0
