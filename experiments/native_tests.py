"""Record a native (GPU) pytest run as results: counts and failing test ids from its JUnit XML.

The device driver runs the kernel, invariance and engine tests natively (``run_h200.sh tests``
and ``gpuengine``) with ``--junitxml``; this turns the XML into one record per stage of
``experiments/results/native-tests-h200.json``, so the README's pass counts are rendered from a
file like every other figure. ``--merge`` keeps the other stages' latest records.

    python -m experiments.native_tests tests results/pytest-tests.xml \\
        --pytest-command "python3 -m pytest ..." --merge experiments/results/native-tests-h200.json
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from experiments.harness import card_tag, header, write_results

MAX_LISTED = 30  # failing ids kept per stage; the count is always whole


def _test_id(case: ET.Element) -> str:
    """``file::test`` as pytest prints it, from JUnit's dotted classname and name."""
    classname = case.get("classname", "")
    parts = classname.split(".")
    # classname is "tests.kernels.test_x" or "tests.kernels.test_x.TestClass"
    module = [p for p in parts if p.startswith("test_")]
    if module:
        idx = parts.index(module[0])
        path = "/".join(parts[: idx + 1]) + ".py"
        rest = parts[idx + 1:]
        return "::".join([path, *rest, case.get("name", "")])
    return f"{classname}::{case.get('name', '')}"


def summarize(xml_path: Path | str) -> dict:
    """Counts of one JUnit XML: passed, failed, errors, skipped, the failing and erroring ids,
    the skip reasons (counted) and pytest's own wall time."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    failed: list[str] = []
    errors: list[str] = []
    skip_reasons: Counter[str] = Counter()
    total = 0
    wall_s = 0.0
    for suite in suites:
        wall_s += float(suite.get("time", 0.0))
        for case in suite.iter("testcase"):
            total += 1
            if case.find("failure") is not None:
                failed.append(_test_id(case))
            elif case.find("error") is not None:
                errors.append(_test_id(case))
            elif (skipped := case.find("skipped")) is not None:
                skip_reasons[(skipped.get("message") or "").strip()[:160]] += 1
    skipped_count = sum(skip_reasons.values())
    return {
        "tests": total,
        "passed": total - len(failed) - len(errors) - skipped_count,
        "failed": len(failed),
        "errors": len(errors),
        "skipped": skipped_count,
        "failed_ids": failed[:MAX_LISTED],
        "error_ids": errors[:MAX_LISTED],
        "skip_reasons": dict(skip_reasons.most_common(10)),
        "pytest_wall_s": round(wall_s, 1),
    }


def record(stage: str, xml_path: Path | str, pytest_command: str) -> dict:
    head = header()
    return {"stage": stage, "date": head["date"], "command": pytest_command, **summarize(xml_path)}


def merged(new: dict, earlier_path: Path | str | None) -> list[dict]:
    """This stage's record after the earlier file's records of the other stages."""
    earlier: list[dict] = []
    if earlier_path and Path(earlier_path).exists():
        earlier = [r for r in json.loads(Path(earlier_path).read_text()) if not r.get("header")]
    return [r for r in earlier if r.get("stage") != new["stage"]] + [new]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", help="the driver stage that ran the tests (tests, gpuengine)")
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--pytest-command", required=True,
                        help="the pytest command line that wrote the XML (recorded as run)")
    parser.add_argument("--merge", default=None, metavar="PATH",
                        help="keep this file's records of the other stages")
    parser.add_argument("--out", default=None, help="results folder (default: CORUN_RESULTS_DIR)")
    parser.add_argument("--name", default=None,
                        help="results file name (default: native-tests-<card>, e.g. "
                             "native-tests-h200)")
    args = parser.parse_args(argv)
    if not args.junit_xml.exists():
        raise SystemExit(f"junit_xml: {args.junit_xml} does not exist (the run wrote nothing)")
    new = record(args.stage, args.junit_xml, args.pytest_command)
    path = write_results(args.name or f"native-tests-{card_tag()}", merged(new, args.merge),
                         args.out,
                         what="native pytest runs on the device, one record per driver stage")
    print(f"{args.stage}: {new['passed']} passed, {new['failed']} failed, {new['errors']} errors, "
          f"{new['skipped']} skipped -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
