"""The GRPO example replays bit for bit: two runs from the same seeds give the same prompts,
seeds, rewards, importance ratios (all exactly 1.0: the trainer forward has the rollout's bits),
system fingerprints after each weight sync and final weights; another seed gives another run."""

from __future__ import annotations

from examples.grpo import GRPOConfig, parity_reward, run

SHORT = GRPOConfig(iterations=3, prompts=4, n=4, device="cpu")
TIMINGS = ("rollout_s", "train_s", "weight_sync_s")


def _replayable(result: dict) -> dict:
    return {**result, "iterations": [{k: v for k, v in it.items() if k not in TIMINGS}
                                     for it in result["iterations"]]}


def test_a_run_replays_bit_for_bit_and_stays_on_policy():
    first = _replayable(run(SHORT, log=lambda line: None))
    second = _replayable(run(SHORT, log=lambda line: None))
    assert first == second
    assert all(it["ratios_exactly_one"] for it in first["iterations"])
    fingerprints = [it["system_fingerprint"] for it in first["iterations"]]
    assert len(set(fingerprints)) == len(fingerprints)  # every step changed the weights


def test_another_seed_is_another_run():
    first = run(SHORT, log=lambda line: None)
    other = run(GRPOConfig(**{**SHORT.__dict__, "seed": 1}), log=lambda line: None)
    assert first["final_weights_digest"] != other["final_weights_digest"]


def test_the_reward():
    assert parity_reward([3, 4], [48, 79, 96, 5]) == 0.5  # even last token: 48..79
    assert parity_reward([4, 3], [96, 127, 48, 1]) == 0.5  # odd: 96..127
