"""``python -m corun.serve``: the OpenAI-compatible server (argparse -> EngineConfig -> uvicorn).

With no ``--model`` it serves the embedded default: ``corun-default``, a small Qwen3-shaped model
with *seeded random weights* and the byte-level tokenizer of ``corun/assets`` (it starts in
seconds on a laptop CPU; its text is noise, deterministic noise). ``--model PATH`` serves an HF
checkpoint directory (``config.json``, safetensors, ``tokenizer.json``, chat template); a named
config of ``models`` (``tiny-qwen3``, ``qwen3-8b``, ...) serves random weights of that shape.

Example::

    python -m corun.serve --mode corun --port 8000   # --port: where it listens (8000)
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "Hello", "max_tokens": 16, "seed": 1}'
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from corun.config import ENGINE_DEFAULTS, PREFILL_POLICIES, EngineConfig
from kernels.mode import Mode

# corun.api.server.DEFAULT_MAX_REQUEST_BODY_BYTES (tests/api/test_cli.py checks it), not
# imported: --help must not import torch and FastAPI.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# uvicorn's own grace once the drain is over: only the last bytes of ended responses remain.
UVICORN_GRACE_S = 5

logger = logging.getLogger("corun.serve")

# The server's defaults are EngineConfig's (the offline engine's) except where a sweep under
# serving load chose otherwise, as vLLM picks its token budget by usage context. Under Poisson
# arrivals each arrival gets a packed prefill step of its own, and the decode batch waits for
# it, so T is what one arrival costs every running request: at the offline T = 8192 corun served
# half of default's throughput, at T = 1024 more than it (experiments/results/serving-step-h200
# and -run2.json; the offline batch prefers 8192, sweep-offline-h200-run4.json). A request's
# bits depend on T, so an offline run reproduces a served one with the same flags; the
# system_fingerprint of each response tells the two apart.
SERVE_DEFAULTS: dict[str, object] = {
    **ENGINE_DEFAULTS,
    "prefill_chunk_size": 512,
    "prefill_step_tokens": 1024,
    "prefill_token_budget": 1024,
}


class _OneDefaultFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where the help does not already say what the default is,
    and never for a flag whose default is None or False (there is nothing to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m corun.serve",
        description="CoRun's OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics.",
        formatter_class=_OneDefaultFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="an HF checkpoint directory (with tokenizer.json) or a named config of "
        "models/ (random weights) (default: the embedded corun-default model, random "
        "weights and a byte-level tokenizer)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name /v1/models lists and requests must use (default: --model, or corun-default)",
    )
    p.add_argument(
        "--mode",
        default="corun",
        choices=[m.value for m in Mode],
        help="corun = fixed-shape prefill steps + fixed-B decode, deterministic; "
        "batch_invariant = dynamic batching with one portable batch-invariant kernel config, "
        "deterministic; batch_invariant_tuned = the same with kernel tiles tuned per shape "
        "(reduction order pinned), deterministic; 'default' = dynamic batching, fastest "
        "kernels, not deterministic (default: corun)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="where a request's sampling defaults come from: 'auto' = the checkpoint's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens, for fields a request leaves out, as vLLM applies them), 'vllm' = none "
        "(OpenAI's defaults), or a folder holding a generation_config.json, whose "
        "max_new_tokens then also caps every request, as in vLLM (default: auto)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=32,
        help="sequences running at once (each sample of n counts)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per sequence; longer requests get 400 (default: 2048, or "
        "the positions the model serves when fewer)",
    )
    p.add_argument(
        "--decode-batch-size",
        type=int,
        default=None,
        help="B, the fixed decode batch of corun mode (default: --max-num-seqs)",
    )
    p.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=SERVE_DEFAULTS["prefill_chunk_size"],
        help="prefill chunk size C (corun prefills in chunks aligned at multiples of C)",
    )
    p.add_argument(
        "--prefill-policy",
        default=SERVE_DEFAULTS["prefill_policy"],
        choices=list(PREFILL_POLICIES),
        help="corun: 'packed' = aligned chunks of several requests in one step of exactly "
        "--prefill-step-tokens tokens; 'isolated' = one chunk per step, padded to its bucket",
    )
    p.add_argument(
        "--prefill-step-tokens",
        type=int,
        default=SERVE_DEFAULTS["prefill_step_tokens"],
        help="T, the token count of a packed corun prefill step",
    )
    p.add_argument(
        "--max-prefill-seqs-per-step",
        type=int,
        default=SERVE_DEFAULTS["max_prefill_seqs_per_step"],
        help="R, chunk rows of a packed corun prefill step",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=SERVE_DEFAULTS["prefill_token_budget"],
        help="corun: padded prefill tokens that may run between two decode steps",
    )
    p.add_argument(
        "--overlap-prefill-decode",
        action="store_true",
        help="corun: each decode step carries one prefill step on a second CUDA stream",
    )
    p.add_argument(
        "--path-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a token's logprob has the same bits when sampled, re-scored (echo) and in the "
        "trainer forward (default: on in every mode but default, which refuses it)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="MoE models: each finished choice carries `routed_experts`, the top-k experts of "
        "every token at every MoE layer (routing replay for RL trainers)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the fraction of the GPU the engine may use; the KV cache takes what the weights "
        "and activations leave of it (default: the cache the config can use, at most what 90%% "
        "of the GPU leaves)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=SERVE_DEFAULTS["enable_prefix_caching"],
        help="reuse the KV of prompt blocks another request already prefilled (hits are "
        "rounded to a granularity that keeps a request's bits the same as a miss)",
    )
    p.add_argument(
        "--decode-split-size",
        type=int,
        default=SERVE_DEFAULTS["decode_split_size"],
        help="decode attention split size in tokens (corun, batch_invariant)",
    )
    p.add_argument(
        "--decode-fused-combine",
        action="store_true",
        help="decode attention combines a sequence's splits in its split launch (one launch; "
        "the same bits)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one dynamic-mode step",
    )
    p.add_argument(
        "--dynamic-graph-tokens",
        type=_graph_tokens,
        default=None,
        help="dynamic modes: token counts (comma-separated) at which a small prefill or mixed "
        "step runs padded from a CUDA graph, or 'none' (default: 128,256,384,512,768,1024 up to "
        "--max-num-batched-tokens, with CUDA graphs)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache blocks (default: enough for --max-num-seqs + 1 full-length "
        "sequences, on a GPU at most what 90%% of it leaves free)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 / float16 / bfloat16 (default: bfloat16 on CUDA, float32 on the CPU)",
    )
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when present)")
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the model over N ranks: N GPUs with NCCL (rank r on GPU r), or N CPU "
        "processes with gloo. This process is rank 0 (it schedules and samples); ranks 1..N-1 "
        "are worker processes, stopped with the server; if one dies the server exits",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (they are only used on CUDA anyway)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of random weights (named configs, the default model); request "
        "seeds are per request",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("CORUN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and "
        "/version (default: the CORUN_API_KEY environment variable, else no key)",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="waiting sequences at most (each prompt x n counts); a request that would go "
        "beyond is refused with 503 and Retry-After",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM or SIGINT: new requests get 503 while those in flight finish, for at "
        "most this long; what still runs then ends with an error, and the server exits 0 "
        "(a second signal exits at once)",
    )
    p.add_argument("--log-level", default="info", help="uvicorn and corun log level")
    return p


def _graph_tokens(text: str) -> tuple[int, ...]:
    """``--dynamic-graph-tokens``: 'none', or comma-separated positive ints."""
    if text.strip().lower() == "none":
        return ()
    try:
        tokens = tuple(int(part) for part in text.split(","))
    except ValueError:
        tokens = ()
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(
            f"expected 'none' or comma-separated positive token counts, got {text!r}")
    return tokens


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the flags (EngineConfig validates them)."""
    from corun.default_model import DEFAULT_MODEL_NAME

    device = args.device
    kwargs = dict(
        model=args.model or DEFAULT_MODEL_NAME,
        mode=args.mode,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        decode_batch_size=args.decode_batch_size,
        prefill_chunk_size=args.prefill_chunk_size,
        prefill_policy=args.prefill_policy,
        prefill_step_tokens=args.prefill_step_tokens,
        max_prefill_seqs_per_step=args.max_prefill_seqs_per_step,
        prefill_token_budget=args.prefill_token_budget,
        overlap_prefill_decode=args.overlap_prefill_decode,
        decode_split_size=args.decode_split_size,
        decode_fused_combine=args.decode_fused_combine,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        dynamic_graph_tokens=args.dynamic_graph_tokens,
        num_kv_blocks=args.num_kv_blocks,
        dtype=args.dtype,  # None: EngineConfig's one default (bf16 on CUDA, fp32 on the CPU)
        device=device,
        cuda_graphs=not args.enforce_eager,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        path_invariant=args.path_invariant,
        enable_return_routed_experts=args.enable_return_routed_experts,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    return kwargs


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def load_tokenizer(model: str | None):
    """``corun.tokenizer.tokenizer_for_model``: the same tokenizer ``LLM`` gets."""
    from corun.default_model import DEFAULT_MODEL_NAME
    from corun.tokenizer import tokenizer_for_model

    try:
        tokenizer, fallback = tokenizer_for_model(model or DEFAULT_MODEL_NAME)
    except ValueError as exc:
        raise SystemExit(f"--model {model}: {exc}") from None
    if fallback:
        logger.warning("--model %s is a named config: serving it with the byte-level tokenizer",
                       model)
    return tokenizer


class _ShutDownOnEngineFailure:
    """The engine died (e.g. a tensor-parallel worker did) and every waiting client got a 500:
    stop the server (graceful shutdown, then ``main`` exits non-zero with the reason) rather than
    answer 503s from a dead engine. Runs on the engine thread."""

    def __init__(self) -> None:
        self.server = None  # the uvicorn.Server, once it exists

    def __call__(self, exc: BaseException) -> None:
        logger.critical("engine failed, shutting the server down: %s", exc)
        if self.server is not None:
            self.server.should_exit = True  # uvicorn polls it; no signal to re-raise


def generation_defaults(args: argparse.Namespace) -> dict:
    """The sampling defaults ``--generation-config`` names (SystemExit for a bad source)."""
    from corun.sampling_params import generation_defaults_of

    try:
        return generation_defaults_of(args.generation_config, args.model)
    except ValueError as exc:
        raise SystemExit(f"--generation-config: {exc}") from None


def max_tokens_ceiling(args: argparse.Namespace, defaults: dict) -> int | None:
    """vLLM: the generation config's max_new_tokens caps every request only when
    ``--generation-config`` names a folder; the model's own file (``auto``) makes it a default."""
    if args.generation_config in ("auto", "vllm"):
        return None
    return defaults.get("max_tokens")


def build_app(args: argparse.Namespace, on_engine_failure=None):
    """The engine (built and warmed up here, before the port opens) and the FastAPI app;
    ``on_engine_failure(exc)`` runs if the engine dies."""
    from corun.api.server import create_app
    from corun.default_model import DEFAULT_MODEL_NAME
    from corun.engine import LLMEngine
    from models.parallel import WorkerError

    check_model_flag(args)
    try:
        config = EngineConfig(**engine_config_kwargs(args))
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    if config.is_cuda and not _cuda_available():
        raise SystemExit(f"--device {config.resolved_device}: this torch sees no CUDA device "
                         f"(torch.cuda.is_available() is False); serve on the CPU with "
                         f"--device cpu")
    tokenizer = load_tokenizer(args.model)
    warn_vocab_mismatch(tokenizer, config.model)
    default_sampling = generation_defaults(args)  # a bad file fails before the engine is built
    if not Path(config.model).is_dir():
        logger.warning(
            "serving %s with RANDOM WEIGHTS (seed %d): its output is deterministic noise, not "
            "language. Pass --model PATH to serve a real checkpoint.",
            config.model,
            config.seed,
        )
    try:
        engine = LLMEngine(config, tokenizer, time_steps=True)  # /metrics' step series
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    except WorkerError as exc:
        raise SystemExit(f"tensor-parallel start-up failed: {exc}") from None
    stats = engine.stats()
    logger.info(
        "engine ready: model %s, mode %s, device %s, backend %s, dtype %s, max_num_seqs %d, "
        "decode buckets %s, prefill / mixed step buckets %s, CUDA graphs %d, "
        "max_model_len %d, %d KV blocks of %d tokens, tensor parallel %d, prefix caching %s",
        config.model,
        config.kernel_mode,
        config.resolved_device,
        config.resolved_backend,
        config.torch_dtype,
        config.max_num_seqs,
        config.decode_buckets,
        f"of {engine.runner.dynamic_step_tokens} tokens"
        if engine.runner.dynamic_step_tokens else "none",
        engine.runner.num_graphs,
        config.max_model_len,
        stats["num_kv_blocks"],
        config.block_size,
        config.tensor_parallel_size,
        f"on (hits at multiples of {config.prefix_cache_granularity} tokens)"
        if config.enable_prefix_caching else "off",
    )
    name = args.served_model_name or (args.model or DEFAULT_MODEL_NAME)
    if default_sampling:
        logger.info("sampling defaults from the generation config, for fields a request leaves "
                    "out (--generation-config vllm turns them off): %s", default_sampling)
    return create_app(
        engine,
        tokenizer,
        model_name=name,
        model_root=args.model or DEFAULT_MODEL_NAME,
        mode=str(config.kernel_mode),
        api_key=args.api_key,
        max_queue_len=args.max_queue_len,
        max_request_body_bytes=args.max_request_body_bytes,
        on_engine_failure=on_engine_failure,
        default_sampling=default_sampling,
        max_tokens_ceiling=max_tokens_ceiling(args, default_sampling),
    )


def warn_vocab_mismatch(tokenizer, model: str) -> None:
    """Warn when the model's vocabulary is much larger than the tokenizer's (a checkpoint with
    another model's tokenizer, or none): ids past the tokenizer's decode to ''. Models pad their
    vocabulary (Qwen3: 151,669 tokens in 151,936 rows; the embedded default: 259 in 384), so a
    tokenizer of at least half the rows is quiet."""
    from corun.memory_plan import model_config_of

    config = model_config_of(model)
    known = getattr(tokenizer, "vocab_size", None)
    if config is None or known is None or 2 * known >= config.vocab_size:
        return
    logger.warning("the model's vocabulary has %d ids, its tokenizer knows %d: sampled ids past "
                   "%d decode to '' (is this checkpoint's tokenizer.json its own?)",
                   config.vocab_size, known, known - 1)


def check_model_flag(args: argparse.Namespace) -> None:
    """``--model`` names a named config or a checkpoint directory (said before anything loads)."""
    from corun.default_model import DEFAULT_MODEL_NAME
    from models import check_model_source

    try:
        check_model_source(args.model or DEFAULT_MODEL_NAME)
    except ValueError as exc:
        raise SystemExit(f"--model: {exc}") from None


def check_port_free(host: str, port: int) -> None:
    """Refuse, before a model is loaded, a host:port that something else listens on."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}): "
                             f"another process holds it; pick another with --port") from None


def _check_flags(args: argparse.Namespace) -> None:
    """The server's own flags (EngineConfig checks the engine's)."""
    if args.max_queue_len < 1:
        raise SystemExit("--max-queue-len: expected a positive int")
    if args.max_request_body_bytes < 1:
        raise SystemExit("--max-request-body-bytes: expected a positive int")
    if not args.shutdown_timeout_s >= 0:
        raise SystemExit("--shutdown-timeout-s: expected a number >= 0")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _check_flags(args)
    check_model_flag(args)
    check_port_free(args.host, args.port)
    import uvicorn

    from corun.api.shutdown import DrainingServer

    on_engine_failure = _ShutDownOnEngineFailure()
    app = build_app(args, on_engine_failure)
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", args.host, args.port)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=UVICORN_GRACE_S,
        ),
        state=app.state.corun,
        shutdown_timeout_s=args.shutdown_timeout_s,
    )
    on_engine_failure.server = server
    server.run()
    error = app.state.corun.engine_loop.error
    if error is not None:
        raise SystemExit(f"corun.serve: the engine failed: {error}")


if __name__ == "__main__":
    sys.exit(main())
