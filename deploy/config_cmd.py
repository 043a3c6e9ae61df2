"""``kvrelay config show [--config FILE]``, ``kvrelay config check FILE`` and ``kvrelay config reference [--out PATH]``.

``check`` and ``show`` judge the file, not this machine: free GPU memory is not read through NVML (a node reads it
when it starts). ``check`` prints ``FILE: ok`` and exits 0, or prints the error (naming the key path, and for an
unknown key the closest known one) and exits 2. ``show`` prints the effective config as YAML: every key, defaults
filled in, secrets redacted (`deploy.config_reference.effective_config`). ``reference`` writes the Markdown
reference (`deploy.config_reference.reference_markdown`), to stdout without ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from kvrelay.deploy.config import DEFAULT_CONFIG, Config, load_config
from kvrelay.deploy.config_reference import REFERENCE_PATH, effective_config, reference_markdown
from kvrelay.deploy.sizes import ConfigError


def _no_gpu_reading() -> int:
    """Stands in for NVML: a file's validity does not depend on the GPU of the machine that checks it."""
    return 0


def _load(path: Path) -> Config:
    return load_config(path, gpu_free_bytes=_no_gpu_reading)


def cmd_config_check(args: argparse.Namespace) -> int:
    try:
        _load(args.file)
    except ConfigError as exc:
        print(f"kvrelay config check: {exc}", file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    try:
        config = _load(args.config)
    except ConfigError as exc:
        print(f"kvrelay config show: {exc}", file=sys.stderr)
        return 2
    raw = yaml.safe_load(Path(args.config).read_text()) or {}
    print(f"# {args.config}, every default filled in, secrets redacted (kvrelay config show)")
    print(yaml.safe_dump(effective_config(config, raw), sort_keys=False), end="")
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    text = reference_markdown()
    if args.out is None:
        print(text, end="")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


def add_config_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvrelay config show|check|reference`` (handlers return an exit code)."""
    p = subparsers.add_parser("config", help="the YAML config: effective values, validation, reference")
    sub = p.add_subparsers(dest="config_command", required=True)
    s = sub.add_parser("show", help="the effective config as YAML: every key, defaults filled in, secrets redacted")
    s.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="default: deploy/configs/local.yaml")
    s.set_defaults(func=cmd_config_show)
    s = sub.add_parser("check", help='validate a config file: prints "FILE: ok" (exit 0) or the error (exit 2)')
    s.add_argument("file", type=Path)
    s.set_defaults(func=cmd_config_check)
    s = sub.add_parser("reference", help="the Markdown reference of every key, generated from the declarations")
    s.add_argument("--out", type=Path, default=None, help=f"write it here (e.g. {REFERENCE_PATH}); default: stdout")
    s.set_defaults(func=cmd_config_reference)
