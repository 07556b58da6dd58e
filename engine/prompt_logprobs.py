"""Prompt logprobs: each prompt token's logprob and rank given the tokens before it.

The model runner computes logits only for sampling rows; a request that asks for prompt
logprobs (OpenAI `echo` with `logprobs`, vLLM's `prompt_logprobs`) also gets the logits
of every prompt position of each chunk it runs, reduced here to the logprob and rank of
the next prompt token (`Request.prompt_logprobs`, `Request.prompt_ranks`) and, with
params.prompt_top_logprobs, the most likely tokens (`Request.prompt_top_logprobs`). The
scheduler gives such a request no prefix-cache hits, so every position is computed; a
chunk recomputed after preemption adds nothing twice.
"""

from __future__ import annotations

import torch

from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.sampler import rank_logprobs
from tandem.engine.scheduler import ScheduledChunk


def record_prompt_logprobs(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    chunks: list[ScheduledChunk],
    query_start_loc: torch.Tensor,
) -> None:
    """Append the prompt logprobs of this step's chunks (rows of `hidden` in chunk order)."""
    for i, chunk in enumerate(chunks):
        req = chunk.request
        if not req.params.prompt_logprobs:
            continue
        # Position p predicts prompt token p + 1; resume where the last chunk stopped.
        start = max(req.num_computed_tokens, len(req.prompt_logprobs))
        end = min(req.num_computed_tokens + chunk.num_new_tokens, req.num_prompt_tokens - 1)
        if end <= start:
            continue
        first_row = int(query_start_loc[i]) + start - req.num_computed_tokens
        logits = model.compute_logits(hidden[first_row : first_row + end - start]).float()
        targets = torch.tensor(req.token_ids(start + 1, end + 1), device=logits.device)
        log_totals = torch.logsumexp(logits, dim=-1, keepdim=True)
        chosen = logits.gather(1, targets.unsqueeze(1))
        req.prompt_logprobs += (chosen - log_totals).squeeze(1).tolist()
        req.prompt_ranks += token_ranks(logits, chosen, targets).tolist()
        if req.params.prompt_top_logprobs:
            k = req.params.prompt_top_logprobs
            req.prompt_top_logprobs += rank_logprobs(logits, log_totals, k)


def token_ranks(logits: torch.Tensor, chosen: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its target token (1 = the largest logit), ties ranked by
    token id as `rank_logprobs` orders them. logits [rows, vocab], chosen [rows, 1] (the
    targets' logits), targets [rows]."""
    above = (logits > chosen).sum(dim=1)
    before = torch.arange(logits.shape[1], device=logits.device) < targets.unsqueeze(1)
    tied_before = ((logits == chosen) & before).sum(dim=1)
    return above + tied_before + 1
