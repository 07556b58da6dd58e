"""HTTP `/admin/*` on the router (behind the API key when one is set; see `router.admin`).

GET  /admin/pools   -> {"workers": [...], "targets": {"prefill": N, "decode": M}, "version"}
POST /admin/scale   {"prefill": N, "decode": M} -> the pools after the change
POST /admin/drain   {"worker_id": "..."} -> the pools after the change
"""

from __future__ import annotations

import json

from aiohttp import web

from tandem.router.admin import PoolsAdmin, parse_targets
from tandem.router.errors import InvalidRequest
from tandem.router.json_fields import check_text
from tandem.router.openai.body_checks import check_expect
from tandem.router.openai.errors import dumps


async def _json_body(request: web.Request) -> object:
    raw = await request.read() or b"null"
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from exc
    check_text(raw, body)
    return body


def add_admin_routes(app: web.Application, admin: PoolsAdmin) -> None:
    async def pools(request: web.Request) -> web.Response:
        return web.json_response(admin.to_json(await admin.get_pools()), dumps=dumps)

    async def scale(request: web.Request) -> web.Response:
        targets = parse_targets(await _json_body(request))
        return web.json_response(admin.to_json(await admin.scale(targets)), dumps=dumps)

    async def drain(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise InvalidRequest('the body must be a JSON object {"worker_id": "..."}')
        for key in body:
            if key != "worker_id":  # as /admin/scale: a misspelt field is not ignored
                raise InvalidRequest(f"unknown field {str(key)[:64]!r}: the body is "
                                     '{"worker_id": "..."}', param=str(key)[:64])  # fmt: skip
        return web.json_response(admin.to_json(await admin.drain(body.get("worker_id"))),
                                 dumps=dumps)  # fmt: skip

    app.router.add_get("/admin/pools", pools, expect_handler=check_expect)
    app.router.add_post("/admin/scale", scale, expect_handler=check_expect)
    app.router.add_post("/admin/drain", drain, expect_handler=check_expect)
