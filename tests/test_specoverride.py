"""`--set section.key=value` on a run spec's text (`protocol/specoverride.py`), and the demo's
use of it: the changed text is what the coordinator would serve and hash."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path

import pytest

from bagel.protocol.runspec import SpecError, load_spec, parse_spec
from bagel.protocol.specoverride import MAX_SETS, set_key, set_keys
from bagel.worker.demo import _markdown, _run_spec, committed_samples, main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml"


def test_a_key_of_the_example_is_replaced_in_its_own_section_and_nothing_else_changes() -> None:
    text = EXAMPLE.read_text()
    out = set_keys(text, ["diloco.overlap=delayed", "diloco.outer_momentum=0.8"])
    spec, before = parse_spec(out), parse_spec(text)
    assert before.diloco.overlap == "off" and spec.diloco.overlap == "delayed"
    assert spec.diloco.outer_momentum == 0.8 and before.diloco.outer_momentum == 0.9
    # every other key parses to what it was: only the two lines differ
    a, b = tomllib.loads(text), tomllib.loads(out)
    b["diloco"].pop("overlap")
    b["diloco"]["outer_momentum"] = a["diloco"]["outer_momentum"]
    assert a == b
    # and as text: one line added at the top of [diloco], one replaced where it stood
    diff = [x for x in difflib.ndiff(text.splitlines(), out.splitlines()) if x[:1] in "+-"]
    assert diff == ['+ overlap = "delayed"', "- outer_momentum = 0.9", "+ outer_momentum = 0.8"]
    lines = out.splitlines()
    assert lines[lines.index('overlap = "delayed"') - 1] == "[diloco]"
    assert spec.spec_hash != before.spec_hash  # another text, another run


def test_values_are_toml_and_a_bare_word_is_a_string() -> None:
    text = '[run]\nid = "r"\n\n[diloco]\ncodec = "int8"\n'
    assert tomllib.loads(set_key(text, "diloco.codec=fp32"))["diloco"]["codec"] == "fp32"
    assert tomllib.loads(set_key(text, 'diloco.codec="int4"'))["diloco"]["codec"] == "int4"
    assert tomllib.loads(set_key(text, "diloco.nesterov=false"))["diloco"]["nesterov"] is False
    assert tomllib.loads(set_key(text, "diloco.inner_steps=10"))["diloco"]["inner_steps"] == 10
    # a section the text lacks is added at the end; a later --set of the same key wins
    got = tomllib.loads(set_keys(text, ["ema.decay=0.9", "ema.decay=0.5"]))
    assert got["ema"] == {"decay": 0.5} and got["diloco"] == {"codec": "int8"}
    # a key that is a prefix of another is not confused with it
    two = "[diloco]\ninner_lr = 0.1\ninner_lr_min = 0.01\n"
    got = tomllib.loads(set_key(two, "diloco.inner_lr=0.2"))["diloco"]
    assert got == {"inner_lr": 0.2, "inner_lr_min": 0.01}


@pytest.mark.parametrize(
    ("text", "item", "says"),
    [
        ("[diloco]\n", "diloco", "expected SECTION.KEY=VALUE"),
        ("[diloco]\n", "Diloco.codec=int8", "expected SECTION.KEY=VALUE"),
        ("[diloco]\n", "diloco.codec=two words", "not a TOML value"),
        ("[diloco]\n", "diloco.codec=a\nb = 1", "on one line"),
        # an array written across lines: replacing its first line would leave its tail behind
        ("[cells]\nx = [\n  1,\n  2,\n]\n", "cells.x=[3]", "no longer parses"),
        # a dotted key this edit cannot see: the value would be written twice or not at all
        ("[model]\nsub.key = 1\n", "model.sub=2", "no longer parses"),
    ],
)
def test_what_a_line_edit_cannot_do_is_refused_with_one_line(text: str, item: str, says: str) -> None:
    with pytest.raises(SpecError) as e:
        set_key(text, item)
    assert says in str(e.value) and "\n" not in str(e.value).strip()


def test_too_many_sets_are_refused() -> None:
    with pytest.raises(SpecError, match=f"at most {MAX_SETS}"):
        set_keys("", ["ema.decay=0.5"] * (MAX_SETS + 1))


def test_the_demo_serves_the_changed_text_and_reports_what_it_changed(tmp_path: Path) -> None:
    path, spec = _run_spec(EXAMPLE, [], tmp_path / "a")
    assert path == EXAMPLE and spec.diloco.overlap == "off" and not (tmp_path / "a").exists()
    path, spec = _run_spec(EXAMPLE, ["diloco.overlap=delayed"], tmp_path / "b")
    assert path == tmp_path / "b" / "run.toml" and spec.diloco.overlap == "delayed"
    assert load_spec(path).spec_hash == spec.spec_hash  # the file written is the spec used
    assert _run_spec(EXAMPLE, [], tmp_path / "b")[0] == EXAMPLE and not path.exists()  # no stale copy left
    # a relative model.init_from is read against the original file's folder, not the output's
    src = tmp_path / "spec" / "run.toml"
    src.parent.mkdir()
    (src.parent / "w.safetensors").write_bytes(b"not read as tensors here")
    src.write_text(EXAMPLE.read_text().replace("[model]\n", '[model]\ninit_from = "w.safetensors"\n'))
    path, spec = _run_spec(src, ["diloco.overlap=delayed"], tmp_path / "c")
    assert Path(spec.init_path) == (src.parent / "w.safetensors").resolve()
    report = {
        "run_id": "r", "wall_s": 1.0, "cells": {}, "workers": {}, "swarm_time": None, "loss_fell_in_every_cell": True,
        "spec": {"path": "examples/x.toml", "set": ["diloco.overlap=delayed"], "overlap": "delayed"},
    }  # fmt: skip
    assert "Run spec: `examples/x.toml` with `diloco.overlap=delayed`; overlap" in _markdown(report)
    # the throughput beside the time split: what the cells committed, per second of wall time
    cells = {"k0.r0": {"samples_committed": 300}, "router": {"samples_committed": 100}, "k0.r1": {}}
    assert committed_samples(cells, 4.0) == {"expert_cells": 300, "router": 100, "per_s": 100.0}
    report["committed_samples"] = committed_samples(cells, 4.0)
    assert "Committed samples: 300 in the expert cells, 100 in the router: 100 per second" in _markdown(report)


def test_a_bad_set_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["--run", str(EXAMPLE), "--out", str(tmp_path / "o"), "--set", "diloco.overlap=sideways"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("demo: ") and err.count("\n") == 1 and "overlap" in err
    rc = main(["--run", str(EXAMPLE), "--out", str(tmp_path / "o"), "--set", "nonsense"])
    err = capsys.readouterr().err
    assert rc == 2 and "expected SECTION.KEY=VALUE" in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "coordinator").exists()
