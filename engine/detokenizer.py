"""Streams a request's generated token ids as text, and finds its stop strings.

The engine feeds every sampled token to the request's `IncrementalDetokenizer` and
forwards `delta_text` to the client. Decoding re-reads only a short window of recent
tokens (the prefix_offset / read_offset scheme of TGI and vLLM), so each token costs O(1)
rather than re-decoding the whole output. Two kinds of text are held back until they are
settled:

* text ending in U+FFFD: the last token(s) end inside a multi-byte UTF-8 character;
* a tail that could still grow into a stop string, so a streaming client never sees part
  of one. When a stop string completes, the output is cut right before it (OpenAI style);
  as in vLLM, only in a token past the request's first `min_tokens`.

A request that ends on a stop token (EOS, one of its `stop_token_ids`, its grammar's
end) keeps the token id but not its text, as vLLM, unless `include_stop_str_in_output`
(`hides_stop_token`).

Exactness: for tokenizers whose decode is a concatenation over tokens (byte-level BPE:
GPT-2, Llama 3, Qwen), the deltas plus `flush()` equal
`tokenizer.decode(output_ids, skip_special_tokens=...)`, cut at the stop string. The
window starts on the last few prompt tokens so that tokenizers which strip a leading space
from the first decoded token (SentencePiece) keep the space before the first output word.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.stop_matcher import StopMatcher

# Prompt tokens placed in the decode window before the first output token (as vLLM).
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def ids_to_text(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """`tokenizer.decode(ids, skip_special_tokens=...)` as a function of (ids, skip).

    For transformers' generic fast tokenizer without its clean-up of tokenization spaces,
    that decode is the Rust tokenizer's own plus ~2 us of Python argument handling
    (transformers 5: 3.1 against 1.0 us for a 6-token window, twice per streamed token):
    the Rust decode is called directly then. Every other tokenizer (a class that
    overrides decoding, clean-up on, slow tokenizers) decodes through `tokenizer.decode`.
    """
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        backend_decode = tokenizer.backend_tokenizer.decode
        return lambda ids, skip: backend_decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def hides_stop_token(
    finish_reason: FinishReason | None, stop_reason: int | str | None, include_stop: bool
) -> bool:
    """Whether a request's last token is a stop token its text leaves out: it ended with
    `stop` on a token (EOS, a stop token id, its grammar's end), not on a stop string,
    and `include_stop` (`include_stop_str_in_output`) is off (vLLM's detokenizer does
    the same)."""
    return (
        finish_reason is FinishReason.STOP and not isinstance(stop_reason, str) and not include_stop
    )


@dataclass
class DetokenizerUpdate:
    """What one new token changed in the visible output."""

    # Text the client may show now; empty while text is held back.
    delta_text: str
    # The stop string that just completed (the output was cut before it, or after it with
    # include_stop_str_in_output), else None.
    stop_string: str | None


class IncrementalDetokenizer:
    """Per-request decoding state; owned by the request, used from the engine thread."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._ids_to_text = ids_to_text(tokenizer)
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = StopMatcher(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        # Stop strings end the output only in a token past the first min_tokens (vLLM).
        self._min_tokens = params.min_tokens

        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a UTF-8 character would make the window's text lengths
        # disagree; such a prompt gets no context (rare: only with raw token-id prompts).
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        # Prompt context followed by every output token; the window is _ids[prefix_offset:].
        self._ids: list[int] = context
        self._num_context_ids = len(context)
        self._prefix_offset = 0  # window start; tokens before it are never decoded again
        self._read_offset = len(context)  # tokens before it are already in _text

        self._text = ""  # all settled output text (cut at the stop string, if one hit)
        self._num_released = 0  # chars of _text already handed out
        self._stop_string: str | None = None

    @property
    def output_text(self) -> str:
        """All output text so far: released plus held back for stop-string matching."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """Every token id passed to `add_token`, in order."""
        return self._ids[self._num_context_ids :]

    @property
    def include_stop(self) -> bool:
        """Whether the output keeps a stop string or stop token (include_stop_str_in_output)."""
        return self._include_stop

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_string

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        """Record one generated token; return the newly releasable text."""
        if self._stop_string is not None:
            raise RuntimeError(f"output already stopped at {self._stop_string!r}")
        self._ids.append(token_id)
        new_text = self._decode_window(final=False)
        if not new_text:
            return DetokenizerUpdate(delta_text="", stop_string=None)
        return self._append_text(new_text)

    def flush(self) -> str:
        """Release everything held back; call when the request finishes for another reason.

        Text still ending in an incomplete character is released as decoded (with U+FFFD),
        exactly as a full decode would show it. If that completes a stop string, the output
        is cut there and `stop_string` is set.
        """
        if self._stop_string is not None:
            return ""
        update = self._append_text(self._decode_window(final=True))
        if update.stop_string is not None:
            return update.delta_text
        delta = self._text[self._num_released :]
        self._num_released = len(self._text)
        return update.delta_text + delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._ids_to_text(token_ids, self._skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """Text of the tokens after read_offset, or "" while it is not settled yet."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (
            len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR)
        ):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _append_text(self, new_text: str) -> DetokenizerUpdate:
        """Add settled text, cut at a completed stop string, release what is safe."""
        self._text += new_text
        if self._stops is None:
            match = None
        else:
            match = self._stops.feed(new_text, report=self._stops_allowed())
        if match is not None:
            self._stop_string = match.stop
            self._text = self._text[: match.end if self._include_stop else match.start]
            delta = self._text[self._num_released :]
            self._num_released = len(self._text)
            return DetokenizerUpdate(delta_text=delta, stop_string=self._stop_string)
        held = 0 if self._stops is None else self._stops.partial_length()
        release_to = max(self._num_released, len(self._text) - held)
        delta = self._text[self._num_released : release_to]
        self._num_released = release_to
        return DetokenizerUpdate(delta_text=delta, stop_string=None)

    def _stops_allowed(self) -> bool:
        """Whether more than min_tokens output tokens are in: a stop string completed in
        an earlier token does not end the output (nor is it found later: the search covers
        only text that ends after the previous call's)."""
        return len(self._ids) - self._num_context_ids > self._min_tokens
