"""aiohttp handlers of the OpenAI-compatible API.

`/v1/completions` and `/v1/chat/completions` parse and validate (protocol.py), run the
request through `RequestFlow` (a completions batch prompt by prompt: prompt_batch.py),
and answer with one JSON object or an SSE stream (responses.py, streaming.py). The
flow's generator is always closed here, on every exit: when the client disconnects the
handler is cancelled (or its write fails), and closing the generator cancels the worker
calls so the workers free the request.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import hdrs, web

from tandem.router.errors import InvalidRequest, ModelNotFound
from tandem.router.json_fields import check_text, get_bool, show
from tandem.router.openai.body_checks import check_expect
from tandem.router.openai.errors import dumps
from tandem.router.openai.prompt_batch import generate_prompts
from tandem.router.openai.protocol import GenerationRequest, RequestParser
from tandem.router.openai.responses import (
    ChatResponses,
    Collected,
    CompletionResponses,
    LogprobsFormatter,
    ResponseBuilder,
    ResponseOptions,
)
from tandem.router.openai.sampling_fields import DEFAULT_MAX_N
from tandem.router.openai.streaming import stream_sse
from tandem.router.openai.tool_responses import ToolChatResponses
from tandem.router.request_flow import RequestFlow
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.tokenization import PromptTokenizer

_JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number"}


class OpenAIHandlers:
    """The OpenAI routes over one served model."""

    def __init__(
        self,
        flow: RequestFlow,
        tokenizer: PromptTokenizer,
        model_name: str,
        model_dir: str,
        max_body_bytes: int,
        dtype: str = "",
        max_n: int = DEFAULT_MAX_N,
        defaults: SamplingDefaults = OPENAI_DEFAULTS,
    ) -> None:
        self.flow = flow
        self.tokenizer = tokenizer
        self.parser = RequestParser(tokenizer, model_name, flow.slo, max_n, defaults)
        self.model_name = model_name
        self.model_dir = model_dir
        self.max_body_bytes = max_body_bytes
        # The workers' weights/KV dtype ("" when unknown), on the model card.
        self.dtype = dtype
        # Reported as the model's `created` time.
        self.started = int(time.time())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions, expect_handler=check_expect)
        app.router.add_post(
            "/v1/chat/completions", self.chat_completions, expect_handler=check_expect
        )
        app.router.add_get("/v1/models", self.list_models, expect_handler=check_expect)
        app.router.add_get("/v1/models/{model:.+}", self.get_model, expect_handler=check_expect)
        app.router.add_post("/tokenize", self.tokenize, expect_handler=check_expect)
        app.router.add_post("/detokenize", self.detokenize, expect_handler=check_expect)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        generations = await self.tokenizer.off_loop(self.parser.completion, body)
        builder = CompletionResponses(
            f"cmpl-{uuid.uuid4().hex}",
            self.model_name,
            int(time.time()),
            LogprobsFormatter(self.tokenizer, generations[0].tokens_as_ids),
            _response_options(generations),
        )
        return await self._run(request, generations, builder)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        generation = await self.tokenizer.off_loop(self.parser.chat, body)
        args = (
            f"chatcmpl-{uuid.uuid4().hex}",
            self.model_name,
            int(time.time()),
            LogprobsFormatter(self.tokenizer, generation.tokens_as_ids),
            _response_options([generation]),
        )
        builder: ChatResponses = (
            ChatResponses(*args)
            if generation.tools is None
            else ToolChatResponses(generation.tools, *args)
        )
        return await self._run(request, [generation], builder)

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]}, dumps=dumps)

    async def get_model(self, request: web.Request) -> web.Response:
        model = request.match_info["model"]
        if model != self.model_name:
            raise ModelNotFound(
                f"the model {show(model)} does not exist; this server serves "
                f"{show(self.model_name)}",
                param="model",
            )
        return web.json_response(self._model_card(), dumps=dumps)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        # vLLM's: each token also as the vocabulary spells it.
        with_strs = get_bool(body, "return_token_strs")
        ids = await self.tokenizer.off_loop(self.parser.tokenize, body)
        answer: dict[str, Any] = {
            "tokens": ids,
            "count": len(ids),
            "max_model_len": self.tokenizer.max_model_len,
        }
        if with_strs:
            answer["token_strs"] = self.tokenizer.token_strs(ids)
        return web.json_response(answer, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._read_json(request)
        text = await self.tokenizer.off_loop(self.parser.detokenize, body)
        return web.json_response({"prompt": text}, dumps=dumps)

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "tandem",
            "root": self.model_dir,
            "parent": None,
            "max_model_len": self.tokenizer.max_model_len,
            **({"dtype": self.dtype} if self.dtype else {}),
        }

    async def _run(
        self, request: web.Request, generations: list[GenerationRequest], builder: ResponseBuilder
    ) -> web.StreamResponse:
        """Runs the request's prompts (one, or a completions batch) and answers."""
        headers = {"X-Request-Id": builder.id}
        first = generations[0]
        chunks = generate_prompts(self.flow, builder.id, generations)
        # Closing the generator (on any exit, cancellation included) cancels the worker calls.
        async with contextlib.aclosing(chunks):
            if first.stream:
                return await stream_sse(request, chunks, builder, headers)
            choices = [Collected() for _ in range(len(generations) * first.extras.n)]
            usage = None
            async for chunk in chunks:
                choices[chunk.index].add(chunk)
                usage = chunk.usage or usage
        body = builder.response(choices, usage)
        return web.json_response(body, headers=headers, dumps=dumps)

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        """The body as a JSON object; 400 if it is not one, 413 if it is too large."""
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            # Refuse before reading a byte of it.
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=length)
        raw = await request.read()  # aiohttp raises 413 past `client_max_size`
        if not raw.strip():
            encoding = request.headers.get(hdrs.CONTENT_ENCODING)
            if encoding and length:  # bytes came, and decoding them gave none
                raise InvalidRequest(
                    f"the request body ({length} bytes, Content-Encoding: {show(encoding)}) "
                    "decodes to nothing; send a JSON object, compressed as its header says"
                )
            raise InvalidRequest("the request body is empty; send a JSON object")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            kind = _JSON_TYPE_NAMES.get(type(body), "a literal")
            raise InvalidRequest(f"the request body must be a JSON object, got {kind}")
        check_text(raw, body)
        return body


def _response_options(generations: list[GenerationRequest]) -> ResponseOptions:
    """The response shape the request's prompts (one, or a completions batch) ask for;
    every prompt of a batch shares the request's other fields."""
    first = generations[0]
    echo = first.echo_text is not None
    return ResponseOptions(
        prompt_ids=[g.prompt_ids for g in generations],
        n=first.extras.n,
        include_usage=first.include_usage,
        continuous_usage=first.continuous_usage,
        return_token_ids=first.return_token_ids,
        echo_texts=[g.echo_text or "" for g in generations] if echo else None,
        logprobs=first.logprobs,
        top_logprobs=first.params.top_logprobs,
        prompt_logprobs=first.prompt_logprobs,
    )
