"""The trainer's forward: the engine's model as a trainable policy whose per-token logprobs are the
engine's bits.

``Policy(model, mode=...)`` holds the same model classes and weights an ``LLM`` of that config
builds (named configs with the same seed, or a checkpoint), as ordinary ``nn.Parameter``s an
optimizer can step. ``Policy.sequence_logprobs`` / ``completion_logprobs`` run a packed batch of
whole sequences through the engine's own kernels at the engine's configs (``OpsConfig``: the
mode, backend, decode split size and path invariance of the ``EngineConfig``), so under path
invariance every returned logprob has exactly the bits ``LLM.generate`` gave the token when it
sampled it and ``LLM.score`` gives it when scoring, whatever the packing. With autograd on, every
op records the gradient of its torch reference (``models/differentiable.py``), and the LM head
and log-softmax are one function that keeps only the final hidden rows and recomputes the
logits tile by tile in the backward (a [tokens, vocabulary] fp32 matrix per batch is what a
trainer cannot hold).

A trainer loop (one process; tensor parallelism and FSDP are the trainer's business)::

    policy = Policy("qwen3-8b", mode="corun")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    logprobs = policy.completion_logprobs(prompts, completions)  # list of [len] tensors
    loss = -sum((lp * adv).sum() for lp, adv in zip(logprobs, advantages))
    loss.backward(); optimizer.step()
    llm.update_weights(policy.checkpoint_weights())  # the engine samples the next rollout

Scope: prefill batches of whole sequences (no cached prefix), tensor parallel size 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from corun.config import EngineConfig
from corun.sampler import Sampler
from models.forward_batch import ForwardBatch, KVCache, OpsConfig

# LM-head rows per tile of the log-softmax's forward and backward: bounds the fp32 logits alive
# at once to [tile, vocabulary] (the engine's LM head keeps a row's bits at any row count).
LOGPROB_TILE = 1024


class Policy(nn.Module):
    """A trainable model with the engine's forward bits. ``**config`` are ``EngineConfig``
    fields (dtype, device, backend, seed, decode_split_size, path_invariant, ...): the ones the
    ``LLM`` whose logprobs it must match was built with."""

    def __init__(self, model: str = "tiny-qwen3", mode: str = "corun", **config) -> None:
        super().__init__()
        from models import build_model

        engine_config = EngineConfig(model=model, mode=mode, **config)
        built = build_model(engine_config.model, dtype=engine_config.torch_dtype,
                            device=engine_config.resolved_device, seed=engine_config.seed)
        self._setup(engine_config, built)

    @classmethod
    def from_model(cls, config: EngineConfig, model: tuple[nn.Module, object]) -> Policy:
        """A policy over an already built ``(model, ModelConfig)`` of ``config`` (shared, not
        copied: its parameters are made trainable)."""
        policy = cls.__new__(cls)
        nn.Module.__init__(policy)
        policy._setup(config, model)
        return policy

    def _setup(self, config: EngineConfig, built: tuple[nn.Module, object]) -> None:
        if config.is_parallel:
            raise ValueError("tensor_parallel_size: the trainer forward runs on one device")
        self.config = config
        self.model, self.model_config = built
        for parameter in self.model.parameters():
            parameter.requires_grad_(True)
        self.device = torch.device(config.resolved_device)
        ops = OpsConfig(mode=config.kernel_mode, backend=config.resolved_backend,
                        decode_split_size=config.decode_split_size,
                        path_invariant=config.is_path_invariant)
        self.ops = dataclasses.replace(ops, differentiable=True)
        self._engine_ops = ops  # the LM head's, inside the log-softmax function
        self.sampler = Sampler(config.resolved_backend, self.device)

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """The weights under the names a checkpoint gives them (views of the parameters, no
        copies, detached): what ``LLM.update_weights`` and ``corun.weight_transfer`` take."""
        from models.loader import checkpoint_views

        return {name: t.detach() for name, t in checkpoint_views(self.model).items()}

    # -- the forward --------------------------------------------------------------------------

    def forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final hidden rows [sum of lengths, H] of the sequences, packed back to back."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("sequences: expected non-empty token id lists")
        lengths = [len(s) for s in sequences]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64,
                           device=self.device)
        return self.model(ids, self._batch(lengths))

    @torch.no_grad()
    def routed_experts(self, sequences: Sequence[Sequence[int]]) -> list:
        """Per sequence, the experts every MoE layer routes each of its tokens to in this
        forward (numpy [len, MoE layers, k]): to check, or replay, the engine's
        ``CompletionOutput.routed_experts`` (which ends one token earlier: no step reads the last
        sampled token)."""
        from corun.routed_experts import RoutedExperts

        c = self.model_config
        layers = [i for i in range(c.num_hidden_layers) if c.is_moe_layer(i)]
        if not layers:
            raise ValueError(f"sequences: {self.config.model} has no MoE layer to route")
        lengths = [len(s) for s in sequences]
        batch = self._batch(lengths)
        block = self.config.block_size
        table = RoutedExperts(batch.kv_cache.num_blocks * block, block, layers,
                              c.num_experts_per_tok, c.num_experts, self.device)
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64,
                           device=self.device)
        self.model(ids, dataclasses.replace(batch, routed_experts=table))
        tables = batch.block_tables.tolist()
        return [table.read(tables[i], n) for i, n in enumerate(lengths)]

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, the fp32 logprobs of its tokens 1..n-1 given the tokens before them."""
        return self._logprobs(sequences, [1] * len(sequences))

    def completion_logprobs(self, prompts: Sequence[Sequence[int]],
                            completions: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per (prompt, completion), the fp32 logprobs of the completion's tokens: what
        ``LLM.generate`` reports for a sample with these tokens, bit for bit under path
        invariance."""
        if len(prompts) != len(completions):
            raise ValueError(f"completions: {len(completions)} for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts) or any(len(c) == 0 for c in completions):
            raise ValueError("prompts, completions: expected non-empty token id lists")
        sequences = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        return self._logprobs(sequences, [len(p) for p in prompts])

    def _logprobs(self, sequences: Sequence[Sequence[int]],
                  first_scored: list[int]) -> list[torch.Tensor]:
        hidden = self(sequences)
        rows, targets, start = [], [], 0
        for seq, first in zip(sequences, first_scored, strict=True):
            rows.append(torch.arange(start + first - 1, start + len(seq) - 1))
            targets.extend(seq[first:])
            start += len(seq)
        rows_t = torch.cat(rows).to(self.device)
        targets_t = torch.tensor(targets, dtype=torch.int64, device=self.device)
        logprobs = _TokenLogprobs.apply(hidden[rows_t], self.model.lm_head.weight, targets_t,
                                        self)
        return list(logprobs.split([len(s) - f for s, f in
                                    zip(sequences, first_scored, strict=True)]))

    def _batch(self, lengths: list[int]) -> ForwardBatch:
        """One prefill step of the whole sequences over a scratch cache of their own blocks."""
        block = self.config.block_size
        blocks = [-(-n // block) for n in lengths]
        if max(lengths) > self.config.max_model_len:
            raise ValueError(f"sequences: {max(lengths)} tokens exceed max_model_len "
                             f"{self.config.max_model_len}")
        # The engine's table width: MLA's decode tile follows max_seq_len (max_model_len), which
        # the table must cover.
        width = self.config.max_blocks_per_seq
        tables = torch.zeros(len(lengths), width, dtype=torch.int32)
        positions, slots, first_block = [], [], 0
        for i, (n, nb) in enumerate(zip(lengths, blocks, strict=True)):
            tables[i, :nb] = torch.arange(first_block, first_block + nb, dtype=torch.int32)
            pos = torch.arange(n)
            positions.append(pos)
            slots.append((first_block + pos // block) * block + pos % block)
            first_block += nb
        cache = KVCache(self.model.kv_cache_spec(), first_block, block, self.config.torch_dtype,
                        self.device)
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
        total = sum(lengths)
        return ForwardBatch(
            is_prefill=True, positions=torch.cat(positions).to(self.device),
            slot_mapping=torch.cat(slots).to(self.device), block_tables=tables.to(self.device),
            kv_cache=cache, ops=self.ops, cu_seqlens_q=cu.to(self.device),
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            max_q_len=max(lengths), max_seq_len=self.config.max_model_len,
            token_mask=torch.ones(total, dtype=torch.bool, device=self.device),
            context_lens_host=tuple(lengths))


class _TokenLogprobs(torch.autograd.Function):
    """LM head + log-softmax at the targets: forward through the engine's LM head and sampler
    (its bits), tile by tile; backward recomputes each tile's logits in torch and applies
    d logprob / d logits = onehot - softmax. Keeps only the hidden rows."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                policy: Policy) -> torch.Tensor:
        model, ops = policy.model, policy._engine_ops
        out = []
        with torch.no_grad():
            for start in range(0, hidden.shape[0], LOGPROB_TILE):
                logits = model.compute_logits(hidden[start:start + LOGPROB_TILE], ops)
                out.append(policy.sampler.logprobs(
                    logits, targets[start:start + LOGPROB_TILE].view(-1, 1))[:, 0])
        ctx.save_for_backward(hidden, weight, targets)
        return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], LOGPROB_TILE):
            rows = hidden[start:start + LOGPROB_TILE].to(weight.dtype)
            logits = F.linear(rows, weight).float()
            d_logits = -torch.softmax(logits, dim=-1)
            d_logits.scatter_add_(1, targets[start:start + LOGPROB_TILE].view(-1, 1),
                                  torch.ones_like(d_logits[:, :1]))
            d_logits *= grad[start:start + LOGPROB_TILE].view(-1, 1)
            if grad_hidden is not None:
                grad_hidden[start:start + LOGPROB_TILE] = (d_logits @ weight.float()).to(
                    hidden.dtype)
            if grad_weight is not None:
                grad_weight += d_logits.t() @ rows.float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None
