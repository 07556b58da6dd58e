"""Chat responses of a request with tools: `tool_calls` in messages and stream deltas.

Streaming follows OpenAI: a call's first delta carries `index`, `id`, `type` and the
function `name`; later deltas carry pieces of `arguments`; the last chunk says
`finish_reason: "tool_calls"`. A named choice streams its arguments as they are
generated; `required` output is a JSON list whose calls are known only once it is
complete, and `auto` output is held back while it may still be a call, so those calls
are sent whole when the reply ends (content that turns out not to be a call is
released as soon as that is clear).
"""

from __future__ import annotations

from typing import Any

from tandem.engine.request import FinishReason
from tandem.router.chunk_stream import public_finish_reason
from tandem.router.openai.responses import ChatResponses, Collected, LogprobsFormatter
from tandem.router.openai.tool_parsers import ToolCall, may_be_tool_call, parse_output
from tandem.router.openai.tools import ToolChoice, ToolPlan
from tandem.router.request_flow import GenerationChunk


def _finish(reason: FinishReason | None, has_calls: bool) -> str | None:
    if has_calls and reason is FinishReason.STOP:
        return "tool_calls"
    return public_finish_reason(reason)


class ToolChatResponses(ChatResponses):
    """`ChatResponses` for a request whose output may be (or must be) tool calls."""

    def __init__(
        self,
        plan: ToolPlan,
        req_id: str,
        model: str,
        created: int,
        logprobs: LogprobsFormatter | None,
        include_usage: bool = False,
    ) -> None:
        super().__init__(req_id, model, created, logprobs, include_usage)
        self.plan = plan
        # Streaming state: output held back, and whether it turned out to be content.
        self._held = Collected()
        self._content = plan.choice is ToolChoice.NONE
        # A named call's id, fixed when its first delta is sent.
        self._named_call: ToolCall | None = None

    def chunk(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        if self._content:
            return super().chunk(chunk)
        if self.plan.choice is ToolChoice.NAMED:
            return self._named_delta(chunk)
        self._held.add(chunk)
        if self.plan.choice is ToolChoice.AUTO and not may_be_tool_call(self._held.text):
            self._content = True  # not a call: release what was held, then stream
            return super().chunk(self._released())
        if chunk.finish_reason is None:
            return None
        parsed = parse_output(self.plan, self._held.text)
        if not parsed.calls:
            return super().chunk(self._released())
        delta: dict[str, Any] = {"tool_calls": [c.json(i) for i, c in enumerate(parsed.calls)]}
        if parsed.content:
            delta["content"] = parsed.content
        return self._delta(delta, self._held.token_ids, self._held.logprobs, chunk, True)

    def _named_delta(self, chunk: GenerationChunk) -> dict[str, Any] | None:
        if not chunk.text and chunk.finish_reason is None:
            return None
        delta: dict[str, Any] = {}
        if chunk.text:
            if self._named_call is None:
                assert self.plan.named is not None
                self._named_call = ToolCall(self.plan.named.name, chunk.text)
                entry = self._named_call.json(0)
            else:
                entry = {"index": 0, "function": {"arguments": chunk.text}}
            delta["tool_calls"] = [entry]
        return self._delta(delta, chunk.token_ids, chunk.logprobs, chunk, True)

    def _delta(
        self,
        delta: dict[str, Any],
        token_ids: list[int],
        logprobs: list[float],
        chunk: GenerationChunk,
        has_calls: bool,
    ) -> dict[str, Any]:
        return self._chunk(
            {
                "delta": delta,
                "logprobs": self._logprobs_of(token_ids, logprobs),
                "finish_reason": _finish(chunk.finish_reason, has_calls),
            }
        )

    def _released(self) -> GenerationChunk:
        held = self._held
        self._held = Collected()
        return GenerationChunk(
            held.token_ids, held.text, held.logprobs, held.finish_reason, held.usage
        )

    def _choice_whole(self, collected: Collected) -> dict[str, Any]:
        parsed = parse_output(self.plan, collected.text)
        if not parsed.calls:
            return super()._choice_whole(collected)
        return {
            "message": {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [c.json() for c in parsed.calls],
            },
            "logprobs": self._logprobs_of(collected.token_ids, collected.logprobs),
            "finish_reason": _finish(collected.finish_reason, True),
        }
