"""`tandem serve`'s cluster-network flags -> one `ClusterAuth` for workers and router
(no cluster is started)."""

from __future__ import annotations

import argparse

import pytest

from tandem.cluster.cli import build_parser, cluster_config_from_args, main
from tandem.cluster.config import ClusterConfig
from tandem.cluster.security_flags import add_security_flags, cluster_auth_from_args
from tandem.proto.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV, ClusterAuth
from tandem.router.config import RouterConfig
from tandem.worker.config import WorkerSettings

TOKEN = "flags-test-token-0123456789"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)


def config_of(model_dir, *flags: str) -> ClusterConfig:
    flags = ("serve", "--model", str(model_dir), "--device", "cpu", *flags)
    args = build_parser().parse_args(flags)
    return cluster_config_from_args(args)


def refused(capsys, model_dir, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(model_dir), "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_serve_generates_one_token_for_workers_and_router(tiny_model_dir):
    config = config_of(tiny_model_dir)
    auth = config.worker.cluster_auth
    assert auth.requires_token and auth.tls is None
    assert config.router.cluster_auth == auth
    # A fresh one per cluster.
    assert config_of(tiny_model_dir).worker.cluster_auth != auth


def test_token_from_env_or_file_flag(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert config_of(tiny_model_dir).worker.cluster_auth == ClusterAuth(token=TOKEN)
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}-file\n")
    config = config_of(tiny_model_dir, "--cluster-token-file", str(token_file))
    assert config.worker.cluster_auth == ClusterAuth(token=f"{TOKEN}-file")
    assert config.router.cluster_auth == config.worker.cluster_auth


def test_bad_token_sources_are_refused(capsys, tiny_model_dir, tmp_path, monkeypatch):
    err = refused(capsys, tiny_model_dir, "--cluster-token-file", str(tmp_path / "missing"))
    assert "--cluster-token-file: cannot read it" in err
    monkeypatch.setenv(TOKEN_ENV, "short")
    assert "cluster token must be a string of at least 16" in refused(capsys, tiny_model_dir)


def test_internal_tls_flags(capsys, tiny_model_dir, tmp_path):
    files = {}
    for name in ("cert", "key", "ca"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("PEM\n")
    config = config_of(
        tiny_model_dir,
        "--internal-tls-cert", str(files["cert"]), "--internal-tls-key", str(files["key"]),
        "--internal-tls-ca", str(files["ca"]), "--internal-tls-server-name", "tandem.internal",
    )  # fmt: skip
    tls = config.worker.cluster_auth.tls
    assert tls is not None and config.router.cluster_auth.tls == tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == tuple(
        str(files[n]) for n in ("cert", "key", "ca")
    )
    assert tls.server_name == "tandem.internal"

    err = refused(capsys, tiny_model_dir, "--internal-tls-cert", str(files["cert"]))
    assert "internal TLS needs --internal-tls-key, --internal-tls-ca as well" in err
    err = refused(
        capsys, tiny_model_dir,
        "--internal-tls-cert", str(files["cert"]), "--internal-tls-key", str(tmp_path / "no"),
        "--internal-tls-ca", str(files["ca"]),
    )  # fmt: skip
    assert "internal TLS key_file" in err
    err = refused(capsys, tiny_model_dir, "--internal-tls-server-name", "x")
    assert "--internal-tls-server-name needs the --internal-tls-* files" in err


def test_joining_command_needs_the_token():
    """A command that joins a running cluster (a second router) cannot invent a token."""
    parser = argparse.ArgumentParser()
    add_security_flags(parser, generates_token=False)
    args = parser.parse_args([])
    with pytest.raises(ValueError, match=f"set \\${TOKEN_ENV} or --cluster-token-file"):
        cluster_auth_from_args(args, {}, generate=False)
    assert cluster_auth_from_args(args, {TOKEN_ENV: TOKEN}, generate=False).token == TOKEN


def test_cluster_config_keeps_router_and_workers_on_one_auth(tiny_model_dir):
    auth = ClusterAuth(token=TOKEN)
    config = ClusterConfig(str(tiny_model_dir), worker=WorkerSettings(cluster_auth=auth))
    assert config.router.cluster_auth == auth
    with pytest.raises(ValueError, match=r"router\.cluster_auth must equal worker\.cluster_auth"):
        ClusterConfig(
            str(tiny_model_dir),
            worker=WorkerSettings(cluster_auth=auth),
            router=RouterConfig(model_dir=str(tiny_model_dir)),
        )
    with pytest.raises(ValueError, match="cluster_auth must be a ClusterAuth"):
        WorkerSettings(cluster_auth=TOKEN)  # type: ignore[arg-type]
