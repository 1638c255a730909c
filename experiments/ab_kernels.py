"""A kernel source change, A/B on the device: the working tree's Triton kernels against a baseline
revision's copy of the same kernel modules, in one process, on the same inputs: are the output
bits the same, and what does each take beside the peer (graph-replayed medians, one run).

The device copies the working tree without git, so the baseline travels as files: ``--export``
(here) writes ``git show REV:kernels/<op>_kernels.py`` into ``experiments/ab_baseline/`` (ignored by
git: pass it to the device call's ``carry``), and the device call loads each file as a module of
its own and, for the baseline's half of every point, puts its JIT functions in place of the
same-named ones wherever a ``kernels`` launcher binds them (``harness.kernels_replaced``),
counting the baseline's launches (a baseline none of whose kernels a point launches is an error).

    python -m experiments.ab_kernels --export 752d0dc kernels/mla_kernels.py (and more files)
    python -m experiments.ab_kernels --cases mla-prefill,attention-prefill --name softmax-fold
        -> experiments/results/ab-softmax-fold-<card>.json

Cases: ``mla-prefill`` (DeepSeek-V3's expanded prefill, one sequence of 512 .. 4096 tokens, beside
causal SDPA with v padded, as experiments/bench_mla.py times it) and ``attention-prefill``
(Qwen3-8B's heads in a scattered paged cache, 512 .. 8192 tokens, beside SDPA flash, as
experiments/bench_attention.py times it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

if __package__ in (None, ""):  # run as a file: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASELINE_DIR = ROOT / "experiments" / "ab_baseline"
SOURCE_FILE = "SOURCE.json"  # which revision and files the baseline folder holds

# A point: its label, the kernel call under test (returns its output), the peer's name and call.
Point = tuple[str, Callable[[], torch.Tensor], str, Callable[[], object]]


def export_baseline(rev: str, files: list[str], out_dir: Path = BASELINE_DIR) -> Path:
    """Write each ``kernels/<op>_kernels.py`` as it is at ``rev`` into ``out_dir``, and
    SOURCE.json."""
    for name in files:  # a JIT-only module: its launchers elsewhere then launch the baseline
        if not (name.startswith("kernels/") and name.endswith("_kernels.py")):
            raise ValueError(f"files: expected kernels/<op>_kernels.py paths (JIT functions "
                             f"whose launchers live in another module), got {name!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    for name in files:
        text = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        (out_dir / Path(name).name).write_text(text)
    (out_dir / SOURCE_FILE).write_text(json.dumps({"rev": commit, "files": files}, indent=1))
    return out_dir


def load_baseline(folder: Path) -> tuple[dict, list[ModuleType]]:
    """(SOURCE.json's record, one module per exported file, each loaded under its own name).

    A baseline module that imports another baselined one (``from kernels.attention_kernels
    import ...`` in mla_kernels.py) gets the baseline's: the files load in import order, each
    with the ones before it standing in for their ``kernels.`` names while it executes."""
    source = json.loads((folder / SOURCE_FILE).read_text())
    stems = [Path(name).stem for name in source["files"]]
    texts = {stem: (folder / f"{stem}.py").read_text() for stem in stems}
    def imports(stem: str, other: str) -> bool:
        return (f"from kernels.{other} import" in texts[stem]
                or f"import kernels.{other}" in texts[stem])

    loaded: dict[str, ModuleType] = {}
    while len(loaded) < len(stems):
        ready = [stem for stem in stems if stem not in loaded and not any(
            imports(stem, other) for other in stems if other != stem and other not in loaded)]
        if not ready:
            raise ValueError(f"baseline: the files import each other in a cycle: {stems}")
        for stem in ready:
            loaded[stem] = _load_module(folder / f"{stem}.py", stem, loaded)
    return source, [loaded[stem] for stem in stems]


def _load_module(path: Path, stem: str, baselined: dict[str, ModuleType]) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ab_baseline_{stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    saved = {name: sys.modules.get(f"kernels.{name}") for name in baselined}
    try:
        sys.modules.update({f"kernels.{name}": m for name, m in baselined.items()})
        spec.loader.exec_module(module)  # Triton reads each JIT function's source from the file
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(f"kernels.{name}", None)
            else:
                sys.modules[f"kernels.{name}"] = previous
    module.ab_replaces = f"kernels.{stem}"
    return module


class BaselineLaunch:
    """A baseline JIT function standing in for the working tree's in a launcher module: launches
    it (``kernel[grid](...)``) and counts them, so an A/B knows the baseline really ran."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: object) -> object:
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name: str) -> object:
        return getattr(self.kernel, name)


@contextmanager
def baseline_kernels(baseline: list[ModuleType]) -> Iterator[list[BaselineLaunch]]:
    """Inside the block, every ``kernels`` launcher module's binding of a JIT function defined in
    a baselined module launches the baseline's function of that name instead (the JIT-only
    ``kernels/<op>_kernels.py`` modules are left alone: their kernels call their own helpers, and
    the baseline's call the baseline's); yields the stand-ins, whose ``launches`` say which ran."""
    from triton.runtime.jit import KernelInterface

    by_source = {m.ab_replaces: {n: BaselineLaunch(v) for n, v in vars(m).items()
                                 if isinstance(v, KernelInterface)} for m in baseline}

    def stand_in(kernel):  # JIT and interpreted functions both keep the Python function as .fn
        fn = getattr(kernel, "fn", None)
        return by_source.get(getattr(fn, "__module__", None), {}).get(
            getattr(fn, "__name__", None), kernel)

    # the launchers: kernels modules other than the JIT-only kernels/<op>_kernels.py ones
    launchers = [m for name, m in sorted(sys.modules.items())
                 if (name == "kernels" or name.startswith("kernels."))
                 and not name.endswith("_kernels")]
    with harness.kernels_replaced(launchers, stand_in):
        yield [k for kernels in by_source.values() for k in kernels.values()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def mla_prefill_points(lengths: tuple[int, ...] = (512, 1024, 2048, 4096)) -> list[Point]:
    from experiments import bench_mla

    dims = bench_mla.v3_dims()
    points = []
    for length in lengths:
        ours, peer, _ = bench_mla.prefill_case(dims, length)
        points.append((f"mla_prefill {length}", ours, "sdpa_v_padded_192", peer))
    return points


def attention_prefill_points(lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
                             ) -> list[Point]:
    from experiments import bench_attention

    points = []
    for length in lengths:
        ours, peer, _ = bench_attention.prefill_case(length, torch.device("cuda"))
        points.append((f"prefill_attention {length}", ours, "sdpa_flash", peer))
    return points


CASES: dict[str, Callable[[], list[Point]]] = {
    "mla-prefill": mla_prefill_points,
    "attention-prefill": attention_prefill_points,
}


def measure(points: list[Point], baseline: list[ModuleType],
            bench: Callable[[Callable[[], object]], float]) -> list[dict]:
    """Per point: the working tree's time, the baseline's, the peer's, and whether the outputs
    are the same bits (each side's output taken before its timing)."""
    from tqdm import tqdm

    records = []
    for label, ours, peer_name, peer in tqdm(points, desc="ab points"):
        out = ours()
        us = bench(ours)
        with baseline_kernels(baseline) as stand_ins:
            base_out = ours()
            if not any(k.launches for k in stand_ins):
                raise ValueError("baseline: no kernel of the baseline modules is launched here")
            base_us = bench(ours)
        peer_us = bench(peer)
        records.append({
            "point": label, "us": round(us, 3), "baseline_us": round(base_us, 3),
            "speedup": round(base_us / us, 4), "peer": peer_name, "peer_us": round(peer_us, 3),
            "ratio": round(peer_us / us, 4), "baseline_ratio": round(peer_us / base_us, 4),
            "same_bits": same_bits(out, base_out),
        })  # fmt: skip
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", nargs="+", metavar=("REV", "FILE"),
                        help="write the baseline: REV then kernels/<op>_kernels.py files")
    parser.add_argument("--baseline-dir", type=Path, default=BASELINE_DIR)
    parser.add_argument("--cases", default="mla-prefill",
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--name", default="change", help="results file: ab-NAME-<card>.json")
    args = parser.parse_args(argv)
    if args.export:
        if len(args.export) < 2:
            parser.error("--export needs a revision and at least one kernels/<op>_kernels.py")
        out = export_baseline(args.export[0], args.export[1:], args.baseline_dir)
        print(f"baseline of {args.export[0]} in {out}")
        return 0
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; expected some of {list(CASES)}")
    if not torch.cuda.is_available():
        print("ab_kernels: needs a CUDA device; nothing measured.", file=sys.stderr)
        return 2
    source, baseline = load_baseline(args.baseline_dir)
    records = []
    for case in cases:
        records += [{"case": case, **r} for r in measure(CASES[case](), baseline, harness.bench_us)]
    for r in records:
        print(f"{r['point']:>24}: {r['us']:9.2f} us vs baseline {r['baseline_us']:9.2f} "
              f"({r['speedup']:.3f}x), of {r['peer']} {r['ratio']:.3f} (was "
              f"{r['baseline_ratio']:.3f}), same bits {r['same_bits']}")  # fmt: skip
    path = harness.write_results(
        f"ab-{args.name}-{harness.card_tag()}", records, baseline_rev=source["rev"],
        baseline_files=source["files"],
        method="harness.bench_us: CUDA-graph replay medians after warm-up, no L2 flush; the "
               "working tree, the baseline and the peer timed one after another per point",
    )  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
