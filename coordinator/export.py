"""`bagel-coordinator export` and `sample`: the argument handling of taking a run's model home.

`export` writes the verified committed weights of every trained cell
(`coordinator/committed.py`; the average of the committed weights where the run keeps one,
`[ema]`), without the outer momentum, in the layout `--format` names
(`models/export.py`); cells that never trained are listed in composition.json's
`missing`. `sample` is `coordinator/sample.py`. Both read the data dir read-only, so they
run beside a live daemon. User mistakes are one error line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_USAGE = 0, 2


def add_parsers(sub: Any) -> None:
    """Register `sample` and `export` on the CLI's subparsers."""
    s = sub.add_parser("sample", help="sample the latest committed model of a run (grid, arrays, manifest)")
    s.add_argument("--data-dir", required=True, type=Path, metavar="DIR", help="the run's data dir (read-only)")
    s.add_argument("--out", required=True, type=Path, metavar="DIR", help="where grid.png, *.npy, manifest.json go")
    s.add_argument("--n", type=int, default=8, metavar="N", help="samples per class (in all if unconditional)")
    s.add_argument("--classes", default=None, metavar="0,3,7", help="classes to sample; default every class")
    s.add_argument("--steps", type=int, default=32, metavar="S", help="Euler steps; default %(default)s")
    s.add_argument("--guidance", type=float, default=1.0, metavar="W", help="CFG weight; default %(default)s")
    s.add_argument("--seed", type=int, default=0, metavar="S", help="noise and routing seed; default %(default)s")
    s.add_argument(
        "--routing",
        default="top1",
        metavar="top1|sample|mixture|prior",
        help="how the composed sampler picks a cluster; default %(default)s",
    )
    s.add_argument(
        "--allow-partial",
        action="store_true",
        help="sample although some needed cell never trained; manifest and grid name the substitutes",
    )
    e = sub.add_parser("export", help="write the latest committed weights (no optimizer state)")
    e.add_argument("--data-dir", required=True, type=Path, metavar="DIR", help="the run's data dir (read-only)")
    e.add_argument("--out", required=True, type=Path, metavar="DIR", help="the export folder")
    e.add_argument("--format", required=True, choices=("safetensors", "diffusers"), help="the layout")


def composition(spec: Any) -> dict[str, Any]:
    """What composing the cells needs beyond their weights (`models/export.py`)."""
    import torch

    from bagel.models import compose, flow
    from bagel.models.data import load_dataset

    ds = load_dataset(spec)
    labels = torch.from_numpy(ds.manifest.train_labels)
    k, c, nc = spec.data.clusters, spec.cells, spec.model.num_classes
    return {
        "run_id": spec.run.id,
        "clusters": k,
        "ranges": [list(r) for r in flow.timestep_ranges(c.timestep_ranges, c.t_mean, c.t_std)],
        "cluster_prior": torch.bincount(labels, minlength=k).float().tolist(),
        "class_given_cluster": compose.class_histogram(labels, ds.y_train, k, nc).tolist() if nc > 0 else None,
        "null_label": nc if nc > 0 else None,
        "num_classes": nc,
        "image_size": spec.model.image_size,
        "channels": spec.model.channels,
    }


def run_export(data_dir: Path, out: Path, fmt: str) -> dict[str, Any]:
    from bagel.coordinator.committed import load_committed
    from bagel.models.export import write_export

    run = load_committed(data_dir)
    cells = {
        c: (
            w.config,
            w.weights,
            {
                "run_id": run.spec.run.id,
                "spec_hash": run.spec_hash,
                "round": str(w.round),
                "state_hash": w.state_hash,
                "weights": "ema" if w.ema else "committed",
            },
        )
        for c, w in run.cells.items()
    }
    if not cells:
        raise ValueError("no cell of this run has a committed state yet: nothing to export")
    comp = composition(run.spec)
    comp["spec_hash"] = run.spec_hash
    comp["missing"] = dict(run.missing)
    comp["rounds"] = {c: w.manifest() for c, w in sorted(run.cells.items())}
    return write_export(out, fmt, cells, comp)


def cmd_sample(args: argparse.Namespace) -> int:
    from bagel.coordinator.committed import CommittedStateError
    from bagel.coordinator.sample import SampleError, SampleRequest, run_sample

    try:
        classes = tuple(int(c) for c in args.classes.split(",")) if args.classes else None
    except ValueError:
        print(f"error: --classes {args.classes!r}: a comma-separated list of class numbers", file=sys.stderr)
        return EXIT_USAGE
    req = SampleRequest(
        n=args.n,
        classes=classes,
        steps=args.steps,
        guidance=args.guidance,
        seed=args.seed,
        routing=args.routing,
        allow_partial=args.allow_partial,
    )
    try:
        manifest = run_sample(args.data_dir, args.out, req)
    except (SampleError, CommittedStateError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    used = ", ".join(f"{c}@{m['round']}" for c, m in manifest["cells"].items())
    subs = manifest["substituted"]
    print(f"sampled {args.out}: cells {used}" + (f"; substituted {', '.join(sorted(subs))}" if subs else ""))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from bagel.coordinator.committed import CommittedStateError
    from bagel.models.export import ExportError

    try:
        doc = run_export(args.data_dir, args.out, args.format)
    except (CommittedStateError, ExportError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    missing = doc.get("missing") or {}
    print(
        f"exported {len(doc['cells'])} cell(s) to {args.out} ({args.format})"
        + (f"; never trained: {', '.join(sorted(missing))}" if missing else "")
    )
    return EXIT_OK
