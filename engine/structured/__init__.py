"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF).

`spec.py` says what a request is constrained to (it travels with `SamplingParams` and on
the wire), `validation.py` checks a spec without a tokenizer (the router's 400s),
`compiler.py` compiles specs into token-level grammars off the engine thread and caches
them, `matcher.py` holds one request's grammar state, `masking.py` applies a batch's
token masks to the logits, and `runtime.py` ties them into the engine's request
lifecycle. The grammar library is xgrammar (why: docs/architecture.md).
"""
