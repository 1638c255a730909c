"""Rendering one README results block from records written to a temporary results folder."""

from __future__ import annotations

import json

from experiments import report


def render_block(tmp_path, monkeypatch, name: str, head: dict, records: list[dict],
                 block: str | None = None) -> str:
    """Write ``[head, *records]`` as ``<name>.json`` under ``tmp_path`` and render the README block
    ``block`` (default ``name``) from it, as ``python -m experiments.report`` would."""
    (tmp_path / f"{name}.json").write_text(json.dumps([head, *records]))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    block = block or name
    return report.render_readme(f"<!-- results:{block} -->\n<!-- /results:{block} -->")
