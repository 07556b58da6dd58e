"""OpenAI-compatible `/v1/completions` over SSE, timed per chunk."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import aiohttp

from tandem.bench.loadgen.clients import ClientConfig, ServerInfo
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import RequestSpec

logger = logging.getLogger(__name__)


class HttpClient:
    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.base_url = config.target.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._prompt_format = config.prompt_format
        self._model = config.model

    async def start(self) -> ServerInfo:
        # No connection limit: the load driver, not the pool, decides the concurrency.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        timeout = aiohttp.ClientTimeout(total=30)
        try:
            async with self._session.get(f"{self.base_url}/v1/models", timeout=timeout) as resp:
                resp.raise_for_status()
                cards = (await resp.json()).get("data") or []
        except (TimeoutError, aiohttp.ClientError) as exc:
            message = f"{self.base_url}/v1/models: {type(exc).__name__}: {exc}"
            raise ConnectionError(message) from exc
        if not cards:
            raise RuntimeError(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == self._model), cards[0])
        if self._model and card.get("id") != self._model:
            raise RuntimeError(f"{self.base_url} does not serve {self._model!r}")
        self._model = str(card["id"])
        max_model_len, vocab_size = card.get("max_model_len"), card.get("vocab_size")
        return ServerInfo(self._model, max_model_len, vocab_size, self._prompt_format)

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": spec.prompt_text if self._prompt_format == "text" else list(spec.prompt_ids),
            "max_tokens": spec.max_tokens,
            "temperature": self.config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.config.strict_openai:
            body["ignore_eos"] = spec.ignore_eos
        return body

    async def stream(self, spec: RequestSpec) -> RequestTrace:
        if self._session is None:
            raise RuntimeError("start() the client first")
        state = _StreamState()
        send_s = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        try:
            async with self._session.post(
                f"{self.base_url}/v1/completions", json=self._body(spec), timeout=timeout
            ) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    state.error = f"HTTP {resp.status}: {text}"
                else:
                    async for line in resp.content:
                        if state.feed(line, time.perf_counter()):
                            break
        except TimeoutError:
            state.error = "timeout"
        except aiohttp.ClientError as exc:
            state.error = f"{type(exc).__name__}: {exc}"
        if not state.error and not state.finish_reason:
            state.error = "stream ended without a finish reason"
        num_output = len(state.times) if state.usage is None else state.usage
        return RequestTrace(
            spec.req_id, spec.tag, state.prompt_usage or spec.prompt_len, spec.max_tokens,
            send_s, time.perf_counter(), state.times, num_output, state.finish_reason, state.error,
        )  # fmt: skip

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _StreamState:
    """What the SSE lines of one response said so far."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.usage: int | None = None
        # Prompt tokens as the server counted them (usage), when it says.
        self.prompt_usage: int | None = None
        self.finish_reason = ""
        self.error = ""

    def feed(self, raw: bytes, now: float) -> bool:
        """Take one SSE line received at `now`; True at `[DONE]` or an error event."""
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            return False  # blank separators, comments, `event:` lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE data: {data[:100]}"
            return True
        if event.get("error"):
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.error = f"stream error: {message}"
            return True
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage = int(usage["completion_tokens"])
            self.prompt_usage = usage.get("prompt_tokens") or self.prompt_usage
        for choice in event.get("choices") or []:
            self.times += [now] * _num_tokens(choice)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return False


def _num_tokens(choice: dict[str, Any]) -> int:
    """How many tokens one streamed choice carries: logprobs' tokens or `token_ids` when
    the server sends them, else one per non-empty text chunk."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0
