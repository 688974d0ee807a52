"""The client subcommands of ``psgrad``: ``models ...``, ``grads`` and ``ready``.

``psgrad._cli`` builds the parser (the server adds ``serve`` and ``worker``) and calls
:func:`add_commands`; each command here is a thin layer over :class:`psgrad.Client`, so it needs
no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from psgrad._cli_dp import add_dp_commands
from psgrad._cli_io import client_of as _client
from psgrad._cli_io import (
    companion,
    connection_options,
    load_array,
    projection_of,
    projection_options,
)
from psgrad._cli_io import names as _names
from psgrad._cli_refsets import add_reference_set_commands
from psgrad._cli_stores import add_store_commands
from psgrad._types import OUTPUT_NAMES, GradsResult, ModelInfo
from psgrad._wire import RESPONSE_KEY, fields_to_safetensors

__all__ = ["add_commands"]

_GRADS_OUTPUTS = [o for o in OUTPUT_NAMES if o not in ("td_errors", "updates")]


def add_commands(sub: Any) -> None:
    """Add ``models``, ``grads``, ``ready`` and the stores', reference sets' and DP runs'
    commands to the ``psgrad`` subcommand parsers."""
    conn = connection_options()
    models = sub.add_parser("models", help="list, show, register, upload, download or delete "
                            "models", description="Manage the server's model registry.")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    p = msub.add_parser("list", parents=[conn], help="list the models")
    p.add_argument("--json", action="store_true", help="print the JSON documents")
    p.set_defaults(func=cmd_models_list)

    p = msub.add_parser("show", parents=[conn], help="describe one model (JSON)")
    p.add_argument("model", help="a model id or id@version")
    p.set_defaults(func=cmd_models_show)

    p = msub.add_parser(
        "register", parents=[conn], help="register a model",
        description="Register a zoo architecture with a config, or a 'sequential' spec of "
                    "allow-listed torch.nn layers. JSON arguments may be given as @file.json.")
    p.add_argument("model", help="the new model's id")
    p.add_argument("--architecture", help="a zoo name, or 'sequential' (or give --pt2)")
    p.add_argument("--pt2", type=Path, help="a torch.export archive (torch.export.save)")
    p.add_argument("--config", type=_json_arg, help="JSON config of a zoo architecture")
    p.add_argument("--layers", type=_json_arg, help="JSON list of layers (sequential)")
    p.add_argument("--input", type=_json_arg, help='JSON input spec, e.g. {"shape": [4]}')
    p.add_argument("--default-loss", help="the loss used when a request names none")
    p.add_argument("--weights", type=Path, help="a .safetensors file of initial weights")
    p.set_defaults(func=cmd_models_register)

    p = msub.add_parser("upload", parents=[conn], help="upload new weights (a new version)")
    p.add_argument("model", help="the model id")
    p.add_argument("weights", type=Path, help="a .safetensors file")
    p.set_defaults(func=cmd_models_upload)

    p = msub.add_parser("download", parents=[conn], help="save a model's weights")
    p.add_argument("model", help="a model id or id@version")
    p.add_argument("output", type=Path, help="the .safetensors file to write")
    p.set_defaults(func=cmd_models_download)

    p = msub.add_parser("delete", parents=[conn], help="delete a model or one id@version")
    p.add_argument("model", help="a model id or id@version")
    p.set_defaults(func=cmd_models_delete)

    p = sub.add_parser(
        "grads", parents=[conn], help="per-sample gradients of a batch read from files",
        description="Compute per-sample gradients (or their statistics) of a batch stored in "
                    ".npy or .safetensors files and write the outputs to a .safetensors file "
                    "(tensors 'norms', 'grads/<param>', ...; metadata 'response' holds the "
                    "model, batch size, timing). Large batches are split into requests the "
                    "server accepts and combined exactly.")
    p.add_argument("model", help="a model id or id@version")
    p.add_argument("--inputs", required=True, help="a .npy file, or a .safetensors file "
                   "(its tensor 'inputs', or its only tensor; FILE:NAME picks one)")
    p.add_argument("--targets", help="the same for targets (default: the tensor 'targets' of "
                   "a .safetensors inputs file, if any)")
    p.add_argument("--output", "-o", type=Path, required=True, help="the .safetensors to write")
    p.add_argument("--outputs", default="grads",
                   help=f"comma-separated outputs (default: grads); any of "
                        f"{', '.join(_GRADS_OUTPUTS)}")
    p.add_argument("--loss", help="the loss (default: the model's)")
    p.add_argument("--params", help="comma-separated parameter names to restrict outputs to")
    p.add_argument("--clip-norm", type=float, help="for clipped_mean")
    p.add_argument("--noise-multiplier", type=float, help="for clipped_mean")
    p.add_argument("--seed", type=int, help="for clipped_mean's noise")
    projection_options(p, dim_help="k, for projection and influence")
    p.add_argument("--reference-set", help="a reference set id, for influence")
    p.add_argument("--chunk-size", type=int, help="the most samples per request")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="draw a progress bar on stderr (default: when stderr is a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_grads)

    p = sub.add_parser(
        "ready", parents=[conn], help="wait until the server is ready",
        description="Wait until the server says it is ready (GET /readyz): its workers are "
                    "warm, so that a request sent now starts now. Prints 'ready' and exits 0; "
                    "exits 1 after --within seconds.")
    p.add_argument("--within", type=float, default=120.0,
                   help="seconds to wait at most (default: 120)")
    p.add_argument("--no-worker", action="store_true",
                   help="ready once jobs can be queued, before any worker (workers that scale "
                        "from zero)")
    p.set_defaults(func=cmd_ready)
    add_reference_set_commands(sub, conn)
    add_store_commands(sub, conn)
    add_dp_commands(sub, conn)


def _json_arg(text: str) -> Any:
    """JSON, or ``@file`` holding it: else a usage error saying which."""
    try:
        raw = Path(text[1:]).read_text() if text.startswith("@") else text
        return json.loads(raw)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None


def _describe(info: ModelInfo) -> str:
    return json.dumps(info.raw or info.__dict__, indent=2, default=str)


def cmd_ready(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.wait_ready(args.within, need_worker=not args.no_worker)
    print("ready")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        models = client.models.list()
    if args.json:
        print(json.dumps([m.raw for m in models], indent=2))
        return 0
    rows = [("ID", "VERSION", "ARCHITECTURE", "DEFAULT LOSS")]
    rows += [(m.id, m.version, m.architecture, m.default_loss) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(_describe(client.models.get(args.model)))
    return 0


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; anything else (a ``torch.save`` pickle, which psgrad never
    reads) is a one-line error saying how to write one."""
    from safetensors import SafetensorError

    if not path.is_file():
        what = "a directory" if path.is_dir() else "not found" if not path.exists() else (
            "not a regular file")
        raise SystemExit(f"psgrad: error: {path} is {what}: give the path of a .safetensors "
                         "file of weights")
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError) as exc:
        raise SystemExit(f"psgrad: error: {path} is not a safetensors file ({exc}): write the "
                         "weights with safetensors.torch.save_file(model.state_dict(), path); "
                         "psgrad never reads torch.save (pickle) files") from None


def cmd_models_register(args: argparse.Namespace) -> int:
    weights = read_weights(args.weights) if args.weights else None
    if (args.pt2 is None) == (args.architecture is None):
        raise SystemExit("psgrad models register: give --architecture or --pt2 (one of them)")
    with _client(args) as client:
        info = client.models.register_exported(
            args.model, args.pt2, default_loss=args.default_loss) if args.pt2 else \
            client.models.register(
            args.model, architecture=args.architecture, config=args.config, layers=args.layers,
            input=args.input, default_loss=args.default_loss, weights=weights)
    print(info.ref)
    return 0


def cmd_models_upload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.models.upload_weights(args.model, read_weights(args.weights)).ref)
    return 0


def cmd_models_download(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    with _client(args) as client:
        weights = client.models.download_weights(args.model)
    try:
        save_file(weights, str(args.output))
    except SafetensorError as exc:  # the Rust writer's words for a path it cannot write
        raise OSError(f"cannot write {args.output}: {exc}") from None
    print(f"{len(weights)} tensors -> {args.output}", file=sys.stderr)
    return 0


def cmd_models_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.models.delete(args.model)))
    return 0


def cmd_grads(args: argparse.Namespace) -> int:
    inputs = load_array(args.inputs, default_name="inputs")
    if args.targets:
        targets: np.ndarray | None = load_array(args.targets, default_name="targets")
    else:  # the file's own 'targets', where inputs come from a safetensors file
        targets = companion(args.inputs, "targets")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    with _client(args) as client:
        result = client.per_sample_grads(
            args.model, inputs, targets, loss=args.loss, outputs=_names(args.outputs) or
            ["grads"], params=_names(args.params), clip_norm=args.clip_norm,
            noise_multiplier=args.noise_multiplier, seed=args.seed, progress=progress,
            chunk_size=args.chunk_size, reference_set=args.reference_set, **projection_of(args))
    write_result(result, args.output)
    print(f"{result.model}: {result.batch_size} samples, {', '.join(result.outputs)} -> "
          f"{args.output}", file=sys.stderr)
    return 0


def write_result(result: GradsResult, path: Path) -> None:
    """The result as a safetensors file in the server's own binary answer format."""
    fields: dict[str, Any] = {"model": result.model, "batch_size": result.batch_size,
                              "loss": result.loss, "timing": result.timing, "meta": result.meta}
    fields.update(result.outputs)
    path.write_bytes(fields_to_safetensors(fields, RESPONSE_KEY))


def run(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run a client command, printing a psgrad error, a file's or an argument's as one line
    (exit status 1)."""
    from psgrad._errors import PsgradError

    try:
        return int(args.func(args))
    except PsgradError as exc:
        rid = f" (request {exc.request_id})" if exc.request_id else ""
        print(f"psgrad: error: {type(exc).__name__}: {exc.message}{rid}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # a file, or an argument the client refuses
        print(f"psgrad: error: {exc}", file=sys.stderr)
        return 1
