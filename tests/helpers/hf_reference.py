"""Hugging Face `transformers` as the reference: random variant models and greedy runs."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from tandem.engine.model_maker import separate_logits

# How far the engine's float32 logprobs may be from transformers': the same math summed
# in another order (and by other kernels on CPUs without AVX-512) is ~1e-4 off in the
# tail, a few 1e-6 of the value (a logprob near -25 was 1.2e-4 off on an AVX2 EPYC).
LOGPROB_TOLERANCE = {"rel": 2e-5, "abs": 3e-4}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_random_model(
    model_cls: type[PreTrainedModel],
    config: PretrainedConfig,
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int = 0,
) -> Path:
    """A seeded random checkpoint of `config`, with the tokenizer of `tokenizer_dir`.

    Weights are drawn wide enough that the layers shape the output (`initializer_range`
    0.1 / sqrt(hidden / 256)) and the logits are separated like the model maker's, so
    greedy argmax is rarely a near-tie and the output varies.
    """
    config.initializer_range = 0.1 / (config.hidden_size / 256) ** 0.5
    torch.manual_seed(seed)
    model = model_cls(config).float()
    separate_logits(model)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt by `AutoModelForCausalLM.generate` (fp32, CPU)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos if isinstance(eos, int) else eos[0],
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_top_logprobs(
    model_dir: Path, prompt: list[int], output: list[int], k: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' k most likely tokens (ties in index order) and their logprobs at each
    position of `output` after `prompt` (fp32, CPU, one forward pass)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    top = []
    for row in logits.float().log_softmax(-1):
        ids = sorted(range(row.shape[0]), key=lambda t: (-row[t].item(), t))[:k]
        top.append((ids, row[ids].tolist()))
    return top


def hf_prompt_scores(model_dir: Path, prompt: list[int], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs of `prompt` by transformers: per position after the first,
    the prompt token then the k most likely (ties by id), each with logprob and rank."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        rows = hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    expected: list[dict | None] = [None]
    for row, token_id in zip(rows, prompt[1:], strict=True):
        order = sorted(range(row.shape[0]), key=lambda t: (-row[t].item(), t))
        entries = {str(token_id): (row[token_id].item(), order.index(token_id) + 1)}
        for rank, t in enumerate(order[:k], start=1):
            entries.setdefault(str(t), (row[t].item(), rank))
        expected.append(entries)
    return expected


def hf_greedy_with(
    model_dir: Path,
    prompt: list[int],
    max_new_tokens: int,
    restrict: Callable[[list[int], torch.Tensor], None],
) -> list[int]:
    """Greedy continuation by transformers (fp32, CPU), one forward pass a token, each
    step's logits row first changed in place by `restrict(tokens generated so far, row)`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generated: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            row = model(torch.tensor([prompt + generated])).logits[0, -1].float()
            restrict(generated, row)
            generated.append(int(row.argmax()))
    return generated
