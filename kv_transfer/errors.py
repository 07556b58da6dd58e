"""Errors of KV transfer; the decode worker acts on them (recompute the prompt or fail).

* `LayoutMismatchError`: the two workers disagree on the KV layout; retrying cannot help.
* `KvPullError`: the KV is gone (expired, released, unknown request) or the peer died /
  timed out; the decode worker recomputes the prompt locally.
"""

from __future__ import annotations


class KvTransferError(Exception):
    """Base of every KV transfer error."""


class LayoutMismatchError(KvTransferError, ValueError):
    """The prefill and decode workers hold KV in different layouts."""


class KvPullError(KvTransferError):
    """A pull failed: the KV is not (or no longer) there, or the peer is unreachable."""
