"""OpenAI-compatible HTTP API of the router (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/tokenize`), mounted on the router's aiohttp app by `router.http_server`.

Request path: `handlers` reads the body, `protocol` validates it into prompt ids and
`SamplingParams`, `RequestFlow` runs it over a worker pair, `responses` / `streaming`
shape the answer; `errors` and `auth` are the app's middlewares.
"""
