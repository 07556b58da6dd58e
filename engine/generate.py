"""Offline batch generation on one engine (demo, tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.llm_engine import Engine
from tandem.engine.outputs import CompletionOutput
from tandem.engine.sampling_params import SamplingParams


def generate(
    engine: Engine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams | list[SamplingParams],
    req_id_prefix: str = "gen",
) -> list[CompletionOutput]:
    """Submit every prompt at once, step until all finish; results in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
    results: dict[str, CompletionOutput] = {}
    order = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
        req_id = f"{req_id_prefix}-{i}"
        request = engine.add_request(req_id, prompt, p)
        results[req_id] = CompletionOutput(req_id, list(request.prompt_token_ids))
        order.append(req_id)
    pending = set(order)
    while pending:
        for out in engine.step():
            result = results[out.req_id]
            result.token_ids += out.new_token_ids
            result.logprobs += out.new_logprobs
            result.top_logprobs += out.new_top_logprobs
            result.text += out.delta_text
            result.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                result.finish_reason = out.finish_reason
                result.stop_reason = out.stop_reason
                pending.discard(out.req_id)
    return [results[r] for r in order]
