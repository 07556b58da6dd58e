"""KvLayout fingerprints and mismatch messages; KvHandle proto round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.engine.config import EngineConfig
from tandem.kv_transfer import KvHandle, KvLayout, KvTransferError, LayoutMismatchError
from tandem.proto.tandem.worker.v1 import worker_pb2

pytestmark = pytest.mark.timeout(30)

LAYOUT = KvLayout("tandem-small-1a2b3c4d", "float32", 16, 12, 4, 64)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "transformers_version": "5.24.0",
}


def write_model(path: Path, **overrides: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **overrides}))
    return path


def test_fingerprint_is_readable_and_round_trips() -> None:
    fp = LAYOUT.fingerprint()
    assert fp == (
        "model=tandem-small-1a2b3c4d;dtype=float32;block_size=16;num_layers=12;"
        "num_kv_heads=4;head_dim=64"
    )
    assert KvLayout.from_fingerprint(fp) == LAYOUT
    LAYOUT.check_matches(fp)


def test_mismatch_names_every_differing_field_with_both_values() -> None:
    other = KvLayout("tandem-small-1a2b3c4d", "bfloat16", 16, 12, 8, 64)
    with pytest.raises(LayoutMismatchError) as err:
        other.check_matches(LAYOUT.fingerprint(), self_role="prefill", other_role="decode")
    message = str(err.value)
    assert message == (
        "KV layout mismatch: dtype: prefill=bfloat16 decode=float32; "
        "num_kv_heads: prefill=8 decode=4"
    )
    assert isinstance(err.value, KvTransferError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "model=x",
        "garbage",
        LAYOUT.fingerprint() + ";extra=1",
        LAYOUT.fingerprint().replace("16", "sixteen"),
    ],
)
def test_malformed_fingerprints_are_mismatches(bad: str) -> None:
    with pytest.raises(ValueError):
        KvLayout.from_fingerprint(bad)
    with pytest.raises(LayoutMismatchError, match="KV layout mismatch"):
        LAYOUT.check_matches(bad)


def test_invalid_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KvLayout("m", "int8", 16, 1, 1, 1)
    with pytest.raises(ValueError, match="model"):
        KvLayout("a;b", "float32", 16, 1, 1, 1)
    with pytest.raises(ValueError, match="block_size"):
        KvLayout("m", "float32", 0, 1, 1, 1)


def test_from_engine_config_identifies_the_architecture(tmp_path: Path) -> None:
    a = KvLayout.from_engine_config(EngineConfig(model=str(write_model(tmp_path / "a" / "m"))))
    assert a.model.startswith("m-") and len(a.model) == len("m-") + 8
    assert (a.dtype, a.block_size, a.num_layers, a.num_kv_heads, a.head_dim) == (
        "float32",
        16,
        12,
        4,
        64,
    )
    # Same architecture elsewhere, saved by another transformers version: same model id.
    copy = write_model(tmp_path / "b" / "m", transformers_version="4.50.0")
    assert KvLayout.from_engine_config(EngineConfig(model=str(copy))) == a
    # Different weights' architecture: the id differs even though the shapes agree.
    other = write_model(tmp_path / "c" / "m", intermediate_size=4096)
    b = KvLayout.from_engine_config(EngineConfig(model=str(other)))
    with pytest.raises(LayoutMismatchError, match=f"model: local={a.model} remote={b.model}"):
        a.check_matches(b.fingerprint())
    bf16 = KvLayout.from_engine_config(EngineConfig(model=str(copy), dtype="bfloat16"))
    assert bf16.dtype == "bfloat16"


def test_handle_proto_round_trip() -> None:
    handle = KvHandle("p0", "10.0.0.1:50051", "req-1", [7, 3, 9], 40, LAYOUT.fingerprint(), 1.5e9)
    msg = handle.to_proto()
    assert isinstance(msg, worker_pb2.KvHandle)
    parsed = worker_pb2.KvHandle.FromString(msg.SerializeToString())
    assert KvHandle.from_proto(parsed) == handle
    assert KvHandle.from_proto(worker_pb2.KvHandle()).block_ids == []
