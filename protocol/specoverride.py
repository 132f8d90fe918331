"""`--set section.key=value`: one key of a run spec's source text, changed before it is parsed.

The demo and the benchmarks run the example spec with a key or two changed (the demo's
`--set diloco.overlap=delayed`, a benchmark's `--set ema.decay=0.9`). The change is made
to the source text, not to the parsed spec, because the source is what the coordinator
serves, hashes (`RunSpec.spec_hash`) and hands to the workers: a run started from the
changed text is an ordinary run of that text.

A value is a TOML value (`0.8`, `true`, `"int8"`, `[1, 2]`); a bare word that is not one
(`delayed`, `int8`) is taken as a string, so a shell user need not quote twice. The key's
line is replaced in its section, or added at the top of the section (the section is added
at the end when the text has none). The result is parsed again and must hold exactly the
value asked for, so a change this line-based edit cannot make (a value that spans lines, a
key written as a dotted or quoted name) is refused with a message instead of being made
wrongly. What the key means and whether its value is valid is `parse_spec`'s to say.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from typing import Any

from bagel.protocol.runspec import SpecError

_ITEM = re.compile(r"([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)=(.*)", re.DOTALL)
_BARE = re.compile(r"[A-Za-z0-9_.:+-]+")
MAX_SETS = 64  # more is a script gone wrong, not a spec


def parse_value(key: str, value: str) -> tuple[Any, str]:
    """(the value, its TOML text) of `value` as given on a command line."""
    if "\n" in value or "\r" in value:
        raise SpecError(f"--set {key}: the value must be on one line")
    try:
        return tomllib.loads(f"v = {value}")["v"], value.strip()
    except tomllib.TOMLDecodeError:
        if _BARE.fullmatch(value):
            return value, json.dumps(value)  # a bare word is a string; JSON's quoting is TOML's
        raise SpecError(f"--set {key}={value}: not a TOML value (quote a string with spaces or symbols)") from None


def set_key(text: str, item: str) -> str:
    """`text` with one `section.key=value` set."""
    m = _ITEM.fullmatch(item.strip())
    if not m:
        raise SpecError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. diloco.overlap=delayed")
    section, key, raw = m.groups()
    value, toml_text = parse_value(f"{section}.{key}", raw)
    lines = text.splitlines()
    header = re.compile(rf"\s*\[\s*{section}\s*\]\s*(#.*)?")
    start = next((i for i, line in enumerate(lines) if header.fullmatch(line)), None)
    new_line = f"{key} = {toml_text}"
    if start is None:
        lines += ["", f"[{section}]", new_line]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
        at = next((i for i in range(start + 1, end) if re.match(rf"\s*{key}\s*=", lines[i])), None)
        if at is None:
            lines.insert(start + 1, new_line)
        else:
            lines[at] = new_line
    out = "\n".join(lines) + "\n"
    try:
        got = tomllib.loads(out).get(section, {})
    except tomllib.TOMLDecodeError as e:
        msg = f"--set {section}.{key}: the spec no longer parses after the change ({e}); edit the file"
        raise SpecError(msg) from None
    if not isinstance(got, dict) or key not in got or got[key] != value:
        raise SpecError(f"--set {section}.{key}: the spec writes this key in a form --set cannot change; edit the file")
    return out


def set_keys(text: str, items: Sequence[str]) -> str:
    """`text` with every `section.key=value` of `items` set, in order (a later one wins)."""
    if len(items) > MAX_SETS:
        raise SpecError(f"--set: at most {MAX_SETS} keys")
    for item in items:
        text = set_key(text, item)
    return text
