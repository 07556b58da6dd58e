"""The router's HTTP side (aiohttp): `/health` and the OpenAI-compatible API.

Middlewares, outermost first: the handler task tracking a stopping router cancels at
the end of its grace, OpenAI error JSON for every failure, the optional API key check,
then the 415 for a body in a content coding aiohttp does not decode. The body size
limit is aiohttp's `client_max_size`. The router serves the app with
`http_protocol_errors.OpenAIErrorsAppRunner`, so the requests aiohttp's own parser
refuses get OpenAI error JSON as well.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from tandem.router.config import RouterConfig
from tandem.router.openai.auth import API_KEY, auth_middleware
from tandem.router.openai.body_checks import check_expect, content_encoding_middleware
from tandem.router.openai.errors import MAX_BODY_BYTES, error_middleware
from tandem.router.openai.handlers import OpenAIHandlers
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.request_flow import RequestFlow
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.tokenization import PromptTokenizer


class HandlerTasks:
    """The tasks of the HTTP requests in flight. aiohttp's shutdown waits its timeout for
    them, then waits it again for a handler that ignores the request's cancellation (a
    stream): a stopping router cancels them itself once its grace is over."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            return await handler(request)
        finally:
            self._tasks.discard(task)

    def cancel_all(self) -> int:
        """Cancel every request in flight; how many."""
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)


HANDLER_TASKS = web.AppKey("handler_tasks", HandlerTasks)


def make_http_app(
    runtime: PolicyRuntime,
    flow: RequestFlow,
    tokenizer: PromptTokenizer,
    config: RouterConfig,
    dtype: str = "",
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> web.Application:
    """`dtype`: the workers' dtype, shown on `/v1/models`. `defaults`: the sampling values
    of requests that leave them out."""

    async def health(request: web.Request) -> web.Response:
        """200 while a request can be served (`PolicyRuntime.is_ready`); `workers`: those
        in the pools."""
        body = {"workers": len(runtime.pool.workers)}
        if await runtime.is_ready():
            return web.json_response({"status": "ok", **body})
        return web.json_response({"status": "unavailable", **body}, status=503)

    handler_tasks = HandlerTasks()
    middlewares: list[Middleware] = [
        handler_tasks.middleware, error_middleware, auth_middleware, content_encoding_middleware,
    ]  # fmt: skip
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[HANDLER_TASKS] = handler_tasks
    app[MAX_BODY_BYTES] = config.max_body_bytes
    if config.api_key is not None:
        app[API_KEY] = config.api_key.encode()
    app.router.add_get("/health", health, expect_handler=check_expect)
    OpenAIHandlers(
        flow, tokenizer, config.model_name, config.model_dir, config.max_body_bytes, dtype,
        max_n=config.max_n, defaults=defaults,
    ).add_routes(app)  # fmt: skip
    return app
