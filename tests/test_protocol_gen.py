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
    # and nothing generated is committed that the protos no longer produce (a stub of a
    # proto without a service, say)
    committed_names = {p.name for p in gen.PROTO_DIR.glob("*_pb2*.py*")}
    assert committed_names == {p.name for p in generated}, "stale generated files: run `make proto`"
