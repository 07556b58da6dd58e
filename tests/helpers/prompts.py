"""Seeded token-id prompts for the tiny models' 2048-token vocabulary (or any other)."""

from __future__ import annotations

import random

# Prompt lengths from one token to most of a 1024-token context.
PROMPT_LENS = (1, 3, 17, 64, 150, 333, 512, 700)


def make_prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 0-2 are <unk>, <s>, </s>: prompts start with BOS and avoid the others.
    return [[1] + [rng.randrange(3, vocab_size) for _ in range(n - 1)] for n in lens]
