"""``psgrad reference-sets put|show|delete``: the server's kept sets of sketches or gradients
(each a small gradient store: ``psgrad stores show|query|delete`` reach the same id)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from psgrad._cli_io import client_of, load_array, names, projection_of, projection_options


def add_reference_set_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Add ``reference-sets`` to the ``psgrad`` subcommand parsers."""
    refs = sub.add_parser("reference-sets", help="make, show or delete a kept reference set",
                          description="Sets of per-sample sketches (or gradients) kept on the "
                                      "server, for 'influence' requests ('--reference-set'); "
                                      "each is a small gradient store ('psgrad stores').")
    rsub = refs.add_subparsers(dest="refs_command", metavar="ACTION", required=True)
    p = rsub.add_parser("put", parents=[conn], help="compute and keep a batch's sketches")
    p.add_argument("id", help="the set's id")
    p.add_argument("model", help="a model id or id@version")
    p.add_argument("--inputs", required=True, help="a .npy or .safetensors[:NAME] file")
    p.add_argument("--targets", help="the same for targets")
    p.add_argument("--loss", help="the loss (default: the model's)")
    p.add_argument("--params", help="comma-separated parameter names")
    projection_options(p, dim_help="k of the sketches (none: full gradients)")
    p.set_defaults(func=_put)
    for name, func, text in (("show", _show, "describe a set (JSON)"),
                             ("delete", _delete, "delete a set")):
        p = rsub.add_parser(name, parents=[conn], help=text)
        p.add_argument("id", help="the set's id")
        p.set_defaults(func=func)


def _put(args: argparse.Namespace) -> int:
    inputs = load_array(args.inputs, default_name="inputs")
    targets = load_array(args.targets, default_name="targets") if args.targets else None
    with client_of(args) as client:
        doc = client.reference_sets.put(
            args.id, args.model, inputs, targets, loss=args.loss, params=names(args.params),
            **projection_of(args))
    print(json.dumps(doc))
    return 0


def _show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.reference_sets.get(args.id)))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.reference_sets.delete(args.id)))
    return 0
