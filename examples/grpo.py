"""A GRPO-style on-policy RL loop with CoRun for rollouts and ``corun.training.Policy`` for the
trainer, on a verifiable toy task; run twice from the same seeds it replays bit for bit.

The task (parity): a prompt is 6 random tokens of 2..9; a completion of 4 tokens earns the
fraction of its tokens in the prompt's target set: tokens 48..79 when the prompt's last token is
even, 96..127 when it is odd. A random model scores ~1/8 (32 of 256 tokens); the policy has to
read the last token to score 1. tiny-qwen3 (2 layers, hidden 64) learns it on the CPU in
about a minute.

Each iteration: the engine samples ``n`` completions per prompt (seeds drawn from the run's
seed and recorded), each with its sampled tokens' logprobs; the rewards give group-relative
advantages (reward minus the group's mean, over the group's standard deviation); the trainer
forward recomputes the same tokens' logprobs with autograd, and the clipped surrogate
``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = exp(logprob_trainer - logprob_rollout)``
is minimised by one optimizer step; the new
weights go to the engine (``LLM.update_weights``) for the next rollout. Under path invariance
``r`` is exactly 1.0 for every token: the loop is on-policy to the bit, and no importance-sampling
correction is needed.

    python -m examples.grpo                       # tiny-qwen3 on the CPU, 60 iterations
    python -m examples.grpo --model qwen3-8b --iterations 3 --max-tokens 64 --optimizer sgd \\
        --record rl-loop-h100                     # a real shape on a GPU, timings recorded

Prints per iteration the mean reward, the ratio's min and max, and the wall time of rollout,
train and weight sync; ends with the final weights' digest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch

from corun import LLM, SamplingParams
from corun.training import Policy
from models.weights import weights_digest

TARGETS = (range(48, 80), range(96, 128))  # the parity task's token sets
PROMPT_TOKENS = range(2, 10)  # what prompts are made of


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    model: str = "tiny-qwen3"
    mode: str = "corun"
    iterations: int = 60
    prompts: int = 16
    n: int = 8
    prompt_len: int = 6
    max_tokens: int = 4
    lr: float = 3e-3
    optimizer: str = "adam"
    clip: float = 0.2
    seed: int = 0
    dtype: str | None = None
    device: str | None = None
    max_model_len: int = 256
    micro_batch_tokens: int = 2048  # trainer tokens whose autograd graph is alive at once


def parity_reward(prompt: list[int], completion: list[int]) -> float:
    """The fraction of the completion's tokens in the prompt's target set."""
    target = TARGETS[prompt[-1] % 2]
    return sum(t in target for t in completion) / len(completion)


def _micro_batches(samples: list, tokens: int) -> list[list[int]]:
    """Sample indices in runs of at most ``tokens`` prompt + completion tokens (one at least)."""
    batches, current, size = [], [], 0
    for i, (prompt, completion) in enumerate(samples):
        length = len(prompt) + len(completion.token_ids)
        if current and size + length > tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += length
    return [*batches, current] if current else batches


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(config: GRPOConfig, log=print) -> dict:
    """The whole loop; returns its record: per iteration the mean reward, ratio extremes,
    seeds and times, and the final weights' digest."""
    engine_kw = dict(dtype=config.dtype, device=config.device, max_model_len=config.max_model_len,
                     seed=config.seed)
    llm = LLM(config.model, mode=config.mode, skip_tokenizer_init=True,
              max_num_seqs=config.prompts * config.n, **engine_kw)
    policy = Policy(config.model, mode=config.mode, **engine_kw)
    optimizer = (torch.optim.Adam(policy.parameters(), lr=config.lr) if config.optimizer == "adam"
                 else torch.optim.SGD(policy.parameters(), lr=config.lr))
    rng = random.Random(config.seed)
    iterations = []
    try:
        for it in range(config.iterations):
            prompts = [[rng.choice(PROMPT_TOKENS) for _ in range(config.prompt_len)]
                       for _ in range(config.prompts)]
            seeds = [rng.getrandbits(63) for _ in prompts]
            start = time.perf_counter()
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                [SamplingParams(n=config.n, max_tokens=config.max_tokens, temperature=1.0,
                                ignore_eos=True, logprobs=0, seed=s) for s in seeds],
                use_tqdm=False)
            rollout_s = time.perf_counter() - start
            samples = [(p, c) for p, out in zip(prompts, outs, strict=True) for c in out.outputs]
            rewards = torch.tensor([parity_reward(p, c.token_ids) for p, c in samples])
            groups = rewards.view(config.prompts, config.n)
            advantages = ((groups - groups.mean(dim=1, keepdim=True))
                          / (groups.std(dim=1, keepdim=True) + 1e-4)).view(-1)

            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            ratios = []
            for batch in _micro_batches(samples, config.micro_batch_tokens):
                chunk = [samples[i] for i in batch]
                logprobs = policy.completion_logprobs([p for p, _ in chunk],
                                                      [c.token_ids for _, c in chunk])
                ratio = torch.cat([torch.exp(lp - torch.tensor(c.logprobs, device=lp.device))
                                   for (_, c), lp in zip(chunk, logprobs, strict=True)])
                adv = torch.cat([advantages[i].repeat(len(samples[i][1].token_ids))
                                 for i in batch]).to(ratio.device)
                clipped = ratio.clamp(1 - config.clip, 1 + config.clip)
                # Gradients accumulate over micro-batches: the loss of the whole group.
                (-torch.minimum(ratio * adv, clipped * adv).sum() / len(samples)).backward()
                ratios.append(ratio.detach())
            ratios = torch.cat(ratios)
            optimizer.step()
            _sync()
            train_s = time.perf_counter() - start

            start = time.perf_counter()
            fingerprint = llm.update_weights(policy.checkpoint_weights())
            _sync()
            sync_s = time.perf_counter() - start
            record = {
                "iteration": it, "mean_reward": round(float(rewards.mean()), 6),
                "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max()),
                "ratios_exactly_one": bool((ratios == 1.0).all()),
                "sampled_tokens": int(ratios.numel()), "seeds": seeds,
                "rollout_s": round(rollout_s, 4), "train_s": round(train_s, 4),
                "weight_sync_s": round(sync_s, 4), "system_fingerprint": fingerprint}
            iterations.append(record)
            log(f"iter {it:3d}  reward {record['mean_reward']:.3f}  ratio "
                f"[{record['ratio_min']:.6f}, {record['ratio_max']:.6f}]  rollout "
                f"{rollout_s:.2f} s  train {train_s:.2f} s  sync {sync_s:.3f} s")
        digest = weights_digest(policy.model)
    finally:
        llm.close()
    log(f"final weights {digest[:16]}")
    return {"config": dataclasses.asdict(config), "iterations": iterations,
            "final_weights_digest": digest}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for field in dataclasses.fields(GRPOConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = {int: int, float: float}.get(type(field.default), str)
        parser.add_argument(flag, type=kind, default=field.default)
    parser.add_argument("--record", default=None, metavar="NAME",
                        help="write experiments/results/NAME.json (header and per-iteration "
                             "records)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    record_name = args.record
    config = GRPOConfig(**{k: v for k, v in vars(args).items() if k != "record"})
    result = run(config)
    if record_name:
        from experiments.harness import write_results

        tokens = [r["sampled_tokens"] for r in result["iterations"]]
        records = [{**r, "rollout_tok_s": round(t / r["rollout_s"], 1)}
                   for r, t in zip(result["iterations"], tokens, strict=True)]
        path = write_results(record_name, records, config=result["config"],
                             final_weights_digest=result["final_weights_digest"],
                             method="wall clock of each phase with a device sync at its end")
        print(f"wrote {path}")
    else:
        print(json.dumps({"final_weights_digest": result["final_weights_digest"],
                          "final_mean_reward": result["iterations"][-1]["mean_reward"]}))


if __name__ == "__main__":
    main()
