"""The committed protobuf stubs are exactly what `make proto` generates."""

import pytest

from tandem.proto.codegen import PROTO_DIR, committed_stubs, generate


@pytest.mark.timeout(150)
def test_generated_stubs_match_proto_sources(tmp_path):
    generated = generate(tmp_path)
    assert generated, "no .proto sources found"
    assert generated == committed_stubs(), (
        "stub files differ from the .proto sources: run `make proto`"
    )
    for rel in generated:
        assert (tmp_path / rel).read_bytes() == (PROTO_DIR / rel).read_bytes(), (
            f"proto/{rel} drifted: run `make proto`"
        )
