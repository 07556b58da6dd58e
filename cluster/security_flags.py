"""Command-line flags of the cluster network: where the cluster token comes from, and
mutual TLS for internal gRPC.

`tandem serve` generates a token when none is given (the workers it starts get it
through their config); a command that joins a running cluster (a second router) takes
it from the pool controller.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

from tandem.proto.cluster_auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    ClusterAuth,
    InternalTls,
    generate_token,
    token_from_environment,
)

logger = logging.getLogger(__name__)

_TLS_FLAGS = {
    "cert_file": "internal_tls_cert",
    "key_file": "internal_tls_key",
    "ca_file": "internal_tls_ca",
}


def add_security_flags(parser: argparse.ArgumentParser, *, generates_token: bool) -> None:
    """The cluster-network flags of a command that starts workers or calls them."""
    group = parser.add_argument_group("cluster network (internal gRPC and KV transfer)")
    otherwise = "a new random one" if generates_token else "required"
    group.add_argument(
        "--cluster-token-file", default=None, metavar="PATH",
        help=f"file holding the cluster token that internal calls and KV pulls carry "
        f"[${TOKEN_ENV}, else the file in ${TOKEN_FILE_ENV}, else {otherwise}]",
    )  # fmt: skip
    group.add_argument(
        "--internal-tls-cert", default=None, metavar="PEM",
        help="certificate chain for mutual TLS on internal gRPC (with --internal-tls-key "
        "and --internal-tls-ca; the files must exist on every node) [no TLS]",
    )  # fmt: skip
    group.add_argument(
        "--internal-tls-key", default=None, metavar="PEM", help="private key of that certificate"
    )
    group.add_argument(
        "--internal-tls-ca", default=None, metavar="PEM",
        help="CA that signed every internal certificate",
    )  # fmt: skip
    group.add_argument(
        "--internal-tls-server-name", default=None, metavar="NAME",
        help="name to check in workers' certificates instead of their address",
    )  # fmt: skip


def cluster_auth_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ, *, generate: bool
) -> ClusterAuth:
    """The cluster's `ClusterAuth` from the flags and environment; with `generate`, a
    new token when none is configured. ValueError names a bad or missing setting."""
    try:
        token = token_from_environment(args.cluster_token_file, environ)
    except OSError as exc:
        raise ValueError(f"--cluster-token-file: cannot read it: {exc}") from exc
    if token is None:
        if not generate:
            raise ValueError(
                f"the cluster token is needed to call its workers: set ${TOKEN_ENV} or "
                "--cluster-token-file"
            )
        token = generate_token()
        logger.info("generated a cluster token for this cluster's internal network")
    given = {field: getattr(args, flag) for field, flag in _TLS_FLAGS.items()}
    tls = None
    if any(given.values()):
        missing = [f"--{_TLS_FLAGS[f].replace('_', '-')}" for f, v in given.items() if not v]
        if missing:
            raise ValueError(f"internal TLS needs {', '.join(missing)} as well")
        tls = InternalTls(**given, server_name=args.internal_tls_server_name or "")
    elif args.internal_tls_server_name:
        raise ValueError("--internal-tls-server-name needs the --internal-tls-* files")
    return ClusterAuth(token=token, tls=tls)


def server_api_key(flag_value: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The public API key a server (`tandem serve`, `tandem router`) requires: `--api-key`,
    else `$TANDEM_API_KEY`, else None (open). An empty or blank key is a ValueError, never
    an open server: an unset shell variable (`--api-key "$KEY"`) or an empty Secret value
    would otherwise switch authentication off without a word."""
    if flag_value is not None:
        source, key = "--api-key", flag_value
    elif "TANDEM_API_KEY" in environ:
        source, key = "TANDEM_API_KEY", environ["TANDEM_API_KEY"]
    else:
        return None
    if not key.strip():
        raise ValueError(f"{source} is empty; give a key, or leave it unset for an open server")
    return key
