"""The router's HTTP side (aiohttp): `/health` now; the OpenAI API joins it later."""

from __future__ import annotations

from aiohttp import web

from router.worker_pool import WorkerPool


def make_http_app(pool: WorkerPool, probe_timeout_s: float) -> web.Application:
    async def health(request: web.Request) -> web.Response:
        if await pool.is_ready(probe_timeout_s):
            return web.json_response({"status": "ok", "workers": len(pool.workers)})
        return web.json_response({"status": "starting"}, status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    return app
