"""Prompt tokenization and length/vocabulary checks at the router (before any worker)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tandem.engine.config import ModelConfig
from tandem.engine.sampling_params import MAX_BAD_WORD_CHARS, MAX_NUM_BAD_WORDS
from tandem.engine.tokenizer_loader import load_tokenizer

_T = TypeVar("_T")


class PromptTokenizer:
    """The served model's tokenizer plus the limits a prompt must respect."""

    def __init__(self, model_dir: str, max_model_len: int | None = None) -> None:
        self.model_dir = str(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        model_config = ModelConfig.from_model_dir(model_dir)
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        # The one thread that parses and tokenizes requests (off_loop); made on first use.
        self._thread: ThreadPoolExecutor | None = None

    async def off_loop(self, work: Callable[..., _T], *args: Any) -> _T:
        """`work(*args)` (a request's parsing and tokenization) on this tokenizer's own
        thread, so that a long prompt does not stall the event loop and with it every
        other request's stream: 6 MB of text takes ~5 s to tokenize, and the loop's
        longest pause while a thread does it was 0.1 s. One thread, as vLLM has: a fast
        tokenizer used from two threads at once can fail ("Already borrowed")."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(work, *args))

    def close(self) -> None:
        """Stop the tokenizer thread (work it has not started is dropped)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt; `add_special_tokens` adds what the tokenizer puts
        around a text of its own (a BOS token, for Llama: an empty text is the BOS alone)."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of a chat (the model's chat template; by default with the assistant
        prompt after it, or, `continue_final_message`, ending inside the last message,
        for the model to go on with); `tools` (OpenAI tool objects) are handed to
        templates that render them, and `template_kwargs` (vLLM's `chat_template_kwargs`,
        e.g. `enable_thinking`) are the template's own variables."""
        if not messages:
            raise ValueError("messages must not be empty")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=None if tools is None else [*tools],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **(template_kwargs or {}),
        )
        return list(ids)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word as it would start a text and,
        where the tokenizer writes it otherwise after a space, as it would follow one.
        (vLLM keeps the second form only when it has as many tokens as the first, so
        with byte-level BPE tokenizers, where " word" is often one token and "word"
        several, it would not ban the word after a space; Tandem bans both forms.)"""
        if len(words) > MAX_NUM_BAD_WORDS:
            raise ValueError(f"may hold at most {MAX_NUM_BAD_WORDS} words, got {len(words)}")
        if (longest := max((len(word) for word in words), default=0)) > MAX_BAD_WORD_CHARS:
            raise ValueError(
                f"words may hold at most {MAX_BAD_WORD_CHARS} characters, got one of {longest}"
            )
        sequences = []
        for word in words:
            bare = word.lstrip()
            alone = self.encode(bare, add_special_tokens=False) if bare else []
            if not alone:
                raise ValueError(f"must hold words, got {word!r}")
            sequences.append(alone)
            spaced = self.encode(" " + bare, add_special_tokens=False)
            if spaced != alone:
                sequences.append(spaced)
        return sequences

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level BPE: "Ġworld" for " world")."""
        return [str(token) for token in self.tokenizer.convert_ids_to_tokens(ids)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        # transformers types decode() for batches too; a flat id list is one string.
        if not isinstance(text, str):
            raise TypeError(f"tokenizer.decode returned {type(text).__name__}, not str")
        return text

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def check_vocabulary(self, name: str, token_ids: Iterable[int]) -> None:
        """ValueError naming field `name` if one of its token ids is outside the vocabulary."""
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{name} holds token id {token_id}, outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )

    def default_max_tokens(self, num_prompt_tokens: int, default: int = 16) -> int:
        """The output limit of a request that sets none: `default` (OpenAI's 16 for
        completions), capped to the room the prompt leaves, as /v1/completions does (at
        least 1: a prompt with no room left is then refused by `check_length`)."""
        return max(1, min(default, self.max_model_len - num_prompt_tokens))

    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the request asks for {num_prompt_tokens + max_tokens} "
                f"({num_prompt_tokens} in the prompt, {max_tokens} to generate)"
            )
