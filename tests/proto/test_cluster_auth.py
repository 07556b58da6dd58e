"""The cluster token's rules: where it comes from, how it is checked, what is logged."""

from __future__ import annotations

import logging
import pickle

import pytest

from tandem.proto.cluster_auth import (
    MIN_TOKEN_LEN,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    ClusterAuth,
    InternalTls,
    RefusalLog,
    generate_token,
    token_from_environment,
)

TOKEN = "unit-test-token-0123456789"


def test_generated_tokens_are_long_random_and_valid():
    tokens = {generate_token() for _ in range(20)}
    assert len(tokens) == 20
    for token in tokens:
        assert len(token) >= 40
        ClusterAuth(token=token)


@pytest.mark.parametrize("token", ["", "short", "x" * (MIN_TOKEN_LEN - 1), "é" * 20, "a\nb" * 8])
def test_weak_or_unsendable_tokens_are_refused(token: str):
    with pytest.raises(ValueError, match="cluster token"):
        ClusterAuth(token=token)


def test_the_token_never_shows_in_repr_and_survives_pickling():
    auth = ClusterAuth(token=TOKEN)
    assert TOKEN not in repr(auth)
    assert pickle.loads(pickle.dumps(auth)) == auth  # Ray ships configs to workers


def test_accepts_only_the_token_and_open_accepts_anything():
    auth = ClusterAuth(token=TOKEN)
    assert auth.requires_token
    assert auth.accepts(TOKEN)
    assert not auth.accepts(None)
    assert not auth.accepts(TOKEN + "x")
    assert not auth.accepts("")
    open_auth = ClusterAuth()
    assert not open_auth.requires_token
    assert open_auth.accepts(None) and open_auth.accepts("anything")


def test_kv_hello_proof_binds_token_and_channel_without_revealing_the_token():
    auth = ClusterAuth(token=TOKEN)
    proof = auth.kv_hello_proof("chan-1")
    assert TOKEN not in proof
    assert auth.accepts_kv_hello("chan-1", proof)
    assert not auth.accepts_kv_hello("chan-2", proof)
    assert not auth.accepts_kv_hello("chan-1", "")
    other = ClusterAuth(token=TOKEN[::-1])
    assert not auth.accepts_kv_hello("chan-1", other.kv_hello_proof("chan-1"))
    assert ClusterAuth().kv_hello_proof("chan-1") == ""
    assert ClusterAuth().accepts_kv_hello("chan-1", "")


def test_fingerprint_names_the_token_without_revealing_it():
    auth = ClusterAuth(token=TOKEN)
    assert auth.fingerprint() == ClusterAuth(token=TOKEN).fingerprint()
    assert auth.fingerprint() != ClusterAuth(token=TOKEN + "x").fingerprint()
    assert TOKEN not in auth.fingerprint()
    assert ClusterAuth().fingerprint() == "open"


def test_token_sources_in_order(tmp_path):
    flag_file = tmp_path / "flag-token"
    flag_file.write_text(f"  {TOKEN}-flag\n")
    env_file = tmp_path / "env-token"
    env_file.write_text(f"{TOKEN}-envfile\n")
    env = {TOKEN_ENV: f"{TOKEN}-env", TOKEN_FILE_ENV: str(env_file)}
    assert token_from_environment(str(flag_file), env) == f"{TOKEN}-flag"
    assert token_from_environment(None, env) == f"{TOKEN}-env"
    assert token_from_environment(None, {TOKEN_FILE_ENV: str(env_file)}) == f"{TOKEN}-envfile"
    assert token_from_environment(None, {}) is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        token_from_environment(str(empty), {})
    with pytest.raises(OSError):
        token_from_environment(str(tmp_path / "missing"), {})


def test_internal_tls_needs_existing_files(tmp_path):
    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="key_file"):
        InternalTls(cert_file=str(pem), key_file=str(tmp_path / "nope"), ca_file=str(pem))
    InternalTls(cert_file=str(pem), key_file=str(pem), ca_file=str(pem))


def test_refusal_log_reports_once_per_interval_with_a_count(caplog: pytest.LogCaptureFixture):
    log = RefusalLog("internal call", interval_s=3600)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            log.refused("/svc/Method", "ipv4:10.0.0.1:5555", "no cluster token")
    assert log.num_refused == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused internal call /svc/Method from ipv4:10.0.0.1:5555: no cluster token"]
    log.interval_s = 0.0
    with caplog.at_level(logging.WARNING):
        log.refused("/svc/Method", "ipv4:10.0.0.1:5555", "wrong cluster token")
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith("wrong cluster token (4 more refused since the last report)")
    )
