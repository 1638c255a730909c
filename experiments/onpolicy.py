"""Train-generation mismatch, measured: each sampled token's logprob against the same token
scored by teacher forcing (``LLM.score``) and by the differentiable trainer forward
(``corun.training``), per model and mode.

Every mode runs the same seeded requests on one set of random weights, all submitted at once so
that each request decodes beside co-runners at the engine's real batch size; each request's
prompt + completion is then scored in one call (packed prefill steps, other chunking than the
generation's) and, with ``--trainer``, run through the trainer forward as packed sequences. A
token counts as equal when the two fp32 logprobs have the same bits. ``default`` is the
negative control: its decode splits follow the batch, so its decode and prefill rows differ.

    python -m experiments.onpolicy --models qwen3-8b --modes corun batch_invariant_tuned default

writes ``experiments/results/onpolicy-<card>.json``: a header record (machine, versions, date,
command, git commit) and one record per (model, mode).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from corun.config import EngineConfig
from corun.engine import LLMEngine
from corun.llm import LLM
from corun.model_runner import ModelRunner
from corun.sampling_params import SamplingParams
from experiments.harness import card_tag, write_results

MODES = ("corun", "batch_invariant_tuned", "batch_invariant", "default")
# A mode without path invariance (EngineConfig.path_invariant=False): what the equal bits cost.
PATH_VARIANTS = {f"{mode}_path_variant": mode for mode in MODES if mode != "default"}


def make_requests(num: int, input_len: tuple[int, int], output_len: int, vocab: int,
                  top_n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Seeded prompts of random token ids, each sampled at temperature 1 with its own seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*input_len))]
               for _ in range(num)]
    params = [SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True,
                             logprobs=top_n, seed=rng.getrandbits(63)) for _ in range(num)]
    return prompts, params


def _bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def compare(generated: list[list[float]], other: list[list[float]]) -> dict:
    """Tokens whose fp32 logprobs have the same bits, and how far the others are (nats)."""
    pairs = [(a, b) for gen, oth in zip(generated, other, strict=True)
             for a, b in zip(gen, oth, strict=True)]
    diffs = [abs(a - b) for a, b in pairs]
    return {"equal": sum(_bits(a) == _bits(b) for a, b in pairs),
            "max_abs_diff": max(diffs, default=0.0),
            "median_abs_diff": statistics.median(diffs) if diffs else 0.0}


def measure_mode(mode: str, model: tuple, prompts: list[list[int]],
                 params: list[SamplingParams], args: argparse.Namespace) -> dict:
    """Generate, score and (optionally) train-forward one mode; the record."""
    engine_mode = PATH_VARIANTS.get(mode, mode)
    config = EngineConfig(
        model=args.model_name, mode=engine_mode, dtype=args.dtype, max_num_seqs=args.batch,
        decode_batch_size=args.batch if engine_mode == "corun" else None,
        max_model_len=args.input_len[1] + args.output_len, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        path_invariant=False if mode in PATH_VARIANTS else None)
    runner = ModelRunner(config, model=model)
    llm = LLM.from_engine(LLMEngine(config, model_runner=runner))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    completions = [o.outputs[0].token_ids for o in outs]
    generated = [o.outputs[0].logprobs for o in outs]
    start = time.perf_counter()
    scored = llm.score([{"prompt_token_ids": p} for p in prompts], completions,
                       logprobs=args.top_n, use_tqdm=False)
    score_s = time.perf_counter() - start
    score_cmp = compare(generated, [s.logprobs for s in scored])
    record = {
        "model": args.model_name, "mode": mode, "path_invariant": config.is_path_invariant,
        "requests": len(prompts), "generated_tokens": sum(map(len, completions)),
        "decode_tokens": sum(len(c) - 1 for c in completions),
        "scored_equal": score_cmp["equal"],
        "first_tokens_scored_equal": sum(_bits(g[0]) == _bits(s.logprobs[0])
                                         for g, s in zip(generated, scored, strict=True)),
        "top_logprobs_equal": sum(
            list(o.outputs[0].top_logprobs[i].items()) == list(s.top_logprobs[i].items())
            for o, s in zip(outs, scored, strict=True) for i in range(len(s.logprobs))),
        "fingerprints_equal": sum(o.outputs[0].fingerprint == s.fingerprint
                                  for o, s in zip(outs, scored, strict=True)),
        "max_abs_diff": score_cmp["max_abs_diff"],
        "median_abs_diff": score_cmp["median_abs_diff"],
        "generate_s": round(generate_s, 3), "score_s": round(score_s, 3),
    }
    llm.close()
    runner.destroy()  # the trainer needs the memory the KV cache held
    if args.trainer:
        record.update(trainer_record(config, model, prompts, completions, generated,
                                     args.trainer_tokens))
    return record


def trainer_record(config: EngineConfig, model: tuple, prompts: list[list[int]],
                   completions: list[list[int]], generated: list[list[float]],
                   micro_batch_tokens: int) -> dict:
    """The trainer forward's logprobs of the completions (packed micro-batches of about
    ``micro_batch_tokens`` tokens, with autograd recording) against the sampled ones, and the
    time of one micro-batch's backward where the gradients fit the device's free memory."""
    from corun.training import Policy

    policy = Policy.from_model(config, model)  # the engine's weights, made trainable
    param_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    logprobs, backward_s, backward_done = [], 0.0, False
    start = time.perf_counter()
    for batch in _micro_batches(prompts, completions, micro_batch_tokens):
        out = policy.completion_logprobs([prompts[i] for i in batch],
                                         [completions[i] for i in batch])
        logprobs.extend(lp.detach().cpu() for lp in out)
        if not backward_done and _free_bytes() > 1.5 * param_bytes:
            begin = time.perf_counter()  # one micro-batch's gradients, at the real shapes
            torch.stack([lp.sum() for lp in out]).sum().backward()
            _sync()
            backward_s, backward_done = time.perf_counter() - begin, True
        del out
    forward_s = time.perf_counter() - start - backward_s
    for parameter in model[0].parameters():  # back to the engine's inference weights
        parameter.grad = None
        parameter.requires_grad_(False)
    cmp = compare(generated, [lp.tolist() for lp in logprobs])
    return {"trainer_equal": cmp["equal"], "trainer_max_abs_diff": cmp["max_abs_diff"],
            "trainer_micro_batch_tokens": micro_batch_tokens,
            "trainer_forward_s": round(forward_s, 3),
            "trainer_backward_s_one_micro_batch": round(backward_s, 3) if backward_done
            else None}


def _free_bytes() -> float:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else float("inf")


def _micro_batches(prompts: list[list[int]], completions: list[list[int]],
                   tokens: int) -> list[list[int]]:
    """Request indices in runs of at most ``tokens`` tokens (at least one request each)."""
    batches, current, size = [], [], 0
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if current and size + len(p) + len(c) > tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += len(p) + len(c)
    return [*batches, current] if current else batches


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_truncated(name: str, layers: int | None, dtype: torch.dtype, device: str,
                    seed: int) -> tuple:
    """A named config's random weights, its first ``layers`` layers only when given."""
    from models import NAMED_CONFIGS, build_model, create_model
    from models.weights import init_random_weights

    if layers is None:
        return build_model(name, dtype=dtype, device=device, seed=seed)
    config = NAMED_CONFIGS[name].with_layers(layers)
    model = create_model(config, dtype=dtype, device=device)
    init_random_weights(model, config.num_hidden_layers, seed)
    model.process_weights_after_loading()
    return model, config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-8b"],
                        help="named configs; NAME:LAYERS keeps the first LAYERS layers (the "
                             "real per-layer shapes of a model too big for the card)")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        choices=[*MODES, *PATH_VARIANTS],
                        help="MODE_path_variant: MODE with path_invariant=False")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 3000))
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--batch", type=int, default=64,
                        help="max_num_seqs of every mode and corun's decode batch B")
    parser.add_argument("--top-n", type=int, default=5, help="top logprobs compared per token")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--trainer", action="store_true",
                        help="also the trainer forward (corun.training) per mode")
    parser.add_argument("--trainer-tokens", type=int, default=2048,
                        help="tokens of one trainer micro-batch (its autograd graph is alive "
                             "at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results file (default onpolicy-<card>)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    records: list[dict] = []
    name = args.name or f"onpolicy-{card_tag() or 'cpu'}"
    extra = {"workload": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                          "output_len": args.output_len, "batch": args.batch,
                          "arrivals": "all at t=0", "temperature": 1.0, "top_n": args.top_n},
             "method": "a token is equal when its sampled fp32 logprob and the scored (or "
                       "trainer) one have the same bits"}
    for spec in args.models:
        model_name, _, layers = spec.partition(":")
        args.model_name = model_name
        probe = EngineConfig(model=model_name, dtype=args.dtype)
        model = build_truncated(model_name, int(layers) if layers else None, probe.torch_dtype,
                                probe.resolved_device, args.seed)
        prompts, params = make_requests(args.num_requests, tuple(args.input_len),
                                        args.output_len, model[1].vocab_size, args.top_n,
                                        args.seed)
        for mode in args.modes:
            record = measure_mode(mode, model, prompts, params, args)
            record["layers"] = model[1].num_hidden_layers
            records.append(record)
            print(json.dumps(record), flush=True)
            path = write_results(name, records, **extra)  # after every record: keep partials
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        del model
        gc.collect()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
