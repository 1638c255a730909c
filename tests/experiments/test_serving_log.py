"""The serving result block read back from a log: the fields print_result writes, per rate."""

from __future__ import annotations

import json

import pytest

from experiments import serving_log
from experiments.serving_client import RequestResult, summarize


def _record(ttft: float) -> dict:
    done = RequestResult(prompt_len=12, success=True, output_tokens=5, ttft=ttft,
                         itl=[0.01, 0.02, 0.01, 0.03], latency=ttft + 0.07, start_time=0.0)
    return summarize([done, done], duration=2.5)


def _log(capsys, records: list[tuple[str, str, dict]], cut_last: bool = False) -> str:
    for mode, rate, record in records:
        print(f"mode={mode} rate={rate} max_concurrency=None")
        print('INFO:     127.0.0.1:1 - "POST /v1/completions HTTP/1.1" 200 OK')
        serving_log.print_result(record)
    text = capsys.readouterr().out
    return text[: text.rindex("=" * 50)] if cut_last else text


def test_the_printed_block_reads_back_to_its_fields(capsys):
    record = _record(0.25)
    text = _log(capsys, [("default", "1.0", record), ("default", "inf", _record(0.5))])
    parsed = serving_log.parse_result_blocks(text)
    runs = [(p["mode"], p["request_rate"]) for p in parsed]
    assert runs == [("default", 1.0), ("default", "inf")]
    for key, value in parsed[0].items():
        if key in ("mode", "request_rate", "max_concurrency"):
            continue
        assert value == pytest.approx(record[key], abs=0.006), key  # printed to 2 decimals
    assert parsed[0]["max_concurrency"] is None and parsed[0]["completed"] == 2


def test_a_block_cut_before_its_closing_rule_is_left_out(capsys):
    text = _log(capsys, [("corun", "2.0", _record(0.1)), ("corun", "4.0", _record(0.1))],
                cut_last=True)
    assert [p["request_rate"] for p in serving_log.parse_result_blocks(text)] == [2.0]


def test_recover_replaces_the_modes_records_and_marks_them(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(_log(capsys, [("default", "1.0", _record(0.2)), ("corun", "1.0", _record(0.3))]))
    results = tmp_path / "ablate.json"
    head = {"header": True, "args": {"model": "qwen3-8b", "random_input_len": "1024",
                                     "random_output_len": "256"}}
    earlier = [{"mode": "corun", "request_rate": 1.0, "output_throughput": 1.0},
               {"mode": "default", "request_rate": 8.0, "output_throughput": 2.0}]
    results.write_text(json.dumps([head, *earlier]))
    serving_log.recover(log, results, mode="default")
    head, *records = json.loads(results.read_text())
    assert records[0] == earlier[0]  # other modes kept as they were
    (default,) = [r for r in records if r["mode"] == "default"]  # the earlier default replaced
    assert default["request_rate"] == 1.0 and default["recovered_from_log"].startswith("run.log")
    assert default["model"] == "qwen3-8b" and default["random_input_len"] == 1024
    assert default["num_prompts"] == 2
    assert head["recovered"] == [{"log": "run.log", "modes": ["default"], "points": 1}]
    with pytest.raises(ValueError, match="no complete result block of mode batch_invariant"):
        serving_log.recover(log, results, mode="batch_invariant")


def test_a_repeated_rate_keeps_its_last_block_and_recovery_is_idempotent(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(_log(capsys, [("default", "1.0", _record(0.2)), ("default", "1.0",
                                                                    _record(0.4))]) + "\n")
    (parsed,) = serving_log.parse_result_blocks(log.read_text())
    assert parsed["median_ttft_ms"] == pytest.approx(400.0)
    results = tmp_path / "ablate.json"
    results.write_text(json.dumps([{"header": True, "args": {}}]))
    serving_log.recover(log, results, mode=None)
    serving_log.recover(log, results, mode=None)
    head, *records = json.loads(results.read_text())
    assert len(records) == 1 and head["recovered"] == [
        {"log": "run.log", "modes": ["default"], "points": 1}]


def test_a_value_that_is_not_a_number_names_its_line():
    text = "mode=default rate=1.0 max_concurrency=None\nSuccessful requests:   many\n"
    with pytest.raises(ValueError, match="Successful requests"):
        serving_log.parse_result_blocks(text)
