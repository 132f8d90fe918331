"""The committed generated protobuf modules must match what the .proto files generate."""

from pathlib import Path

from bagel.protocol import gen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generated = gen.generate(tmp_path)
    assert generated, "no proto files generated"
    for path in generated:
        committed = gen.PROTO_DIR / path.name
        assert committed.exists(), f"protocol/{path.name} is missing: run `make proto`"
        assert committed.read_text() == path.read_text(), f"protocol/{path.name} is stale: run `make proto`"
