"""``psgrad stores create|add|query|show|list|delete``: gradient stores from the shell.

Arrays come from ``.npy`` or ``.safetensors[:NAME]`` files (never pickles); sample ids from a
``.npy`` of integers or strings, or ``--first-id N`` (N, N+1, ... in file order); ``add
--rows`` imports rows made elsewhere. Answers are JSON on stdout; ``add`` draws a progress bar
on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from psgrad._cli_io import client_of, load_array, names, projection_options


def add_store_commands(sub: Any, conn: argparse.ArgumentParser) -> None:
    """Add ``stores`` to the ``psgrad`` subcommand parsers."""
    stores = sub.add_parser("stores", help="make, fill, query, show or delete gradient stores",
                            description="Gradient stores: every training sample's sketch kept "
                                        "on the server, ranked for test samples "
                                        "(docs/attribution.md).")
    ssub = stores.add_subparsers(dest="stores_command", metavar="ACTION", required=True)
    p = ssub.add_parser("create", parents=[conn], help="define a store")
    p.add_argument("id", help="the store's id")
    p.add_argument("model", help="a model id or id@version (the store pins the version)")
    projection_options(p, dim_help="k of the sketches (leave out: full gradients, for models "
                       "of at most 8192 selected values)")
    p.add_argument("--loss", help="the loss (default: the model's; margin for TRAK)")
    p.add_argument("--params", help="comma-separated parameter names")
    p.add_argument("--dtype", choices=["float32", "float16"], help="how rows are kept")
    p.add_argument("--index", help="a FAISS factory string (IVF1024,Flat, ...): an approximate "
                   "index for dot and trak queries")
    p.set_defaults(func=_create)
    p = ssub.add_parser("add", parents=[conn], help="add samples, or import rows (skips ids "
                                                    "already held)")
    p.add_argument("id", help="the store's id")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--inputs", help="samples: a .npy or .safetensors[:NAME] file")
    what.add_argument("--rows", help="or rows made elsewhere [n, projection_dim] (the store's "
                      "sketches, or flattened gradients), imported as they are")
    p.add_argument("--targets", help="the samples' targets, as --inputs")
    ids = p.add_mutually_exclusive_group()
    ids.add_argument("--ids", help="a .npy file of integer or string ids, one per sample")
    ids.add_argument("--first-id", type=int, help="ids N, N+1, ... (default 0 for an empty "
                     "store; a store with samples needs it or --ids)")
    p.add_argument("--batch-size", type=int, help="samples per request (256; rows: 16384)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_add)
    p = ssub.add_parser("query", parents=[conn], help="the top k training samples per test "
                                                      "sample (JSON: ids, scores)")
    p.add_argument("id", help="the store's id")
    p.add_argument("--inputs", help="test samples: a .npy or .safetensors[:NAME] file")
    p.add_argument("--targets", help="their targets")
    p.add_argument("--sketches", help="or their sketches [queries, k]")
    p.add_argument("-k", type=int, default=10, help="how many per test sample (default 10)")
    p.add_argument("--score", default="trak",
                   choices=["trak", "dot", "cosine", "self_influence", "kfac", "ekfac"])
    p.add_argument("--lambda", dest="lam", type=float, help="trak's lambda (default: "
                   "trace(Phi^T Phi) / k, no row counting for more than all the others)")
    p.add_argument("--exact", action="store_true", help="score every row, not through the "
                   "store's index")
    p.add_argument("--damping", type=float, help="kfac's and ekfac's damping (default: a tenth "
                   "of the Fisher's mean eigenvalue)")
    p.add_argument("--probes", type=int, help="an IVF index's lists searched per query "
                   "(default 64): more for recall, fewer for speed")
    p.set_defaults(func=_query)
    p = ssub.add_parser("factors", parents=[conn], help="fit a store's K-FAC factors and EK-FAC "
                                                        "eigenvalues over samples (repeatable)")
    p.add_argument("id", help="the store's id")
    p.add_argument("--inputs", required=True, help="samples: a .npy or .safetensors[:NAME] file")
    p.add_argument("--targets", help="their targets, as --inputs")
    p.add_argument("--batch-size", type=int, default=256, help="samples per request (256)")
    p.add_argument("--resume", action="store_true", help="skip as many leading samples as each "
                   "pass holds (an interrupted fit of the same samples)")
    p.add_argument("--passes", choices=["both", "factors", "eigenvalues"], default="both",
                   help="the K-FAC factors, then EK-FAC's eigenvalues in their bases (both, the "
                   "default); or one: factors over many runs, then eigenvalues")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_factors)
    for name, func, text in (("show", _show, "describe a store (JSON)"),
                             ("delete", _delete, "delete a store")):
        p = ssub.add_parser(name, parents=[conn], help=text)
        p.add_argument("id", help="the store's id")
        p.set_defaults(func=func)
    p = ssub.add_parser("list", parents=[conn], help="your stores (JSON)")
    p.set_defaults(func=_list)


def _create(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        store = client.stores.create(
            args.id, args.model, projection_dim=args.projection_dim, loss=args.loss,
            params=names(args.params), projection_seed=args.projection_seed,
            projection_kind=args.projection_kind, dtype=args.dtype, index=args.index)
    print(json.dumps(store.info))
    return 0


SKIPPED = 3  # the exit status of an add that skipped samples whose ids the store held


def _add(args: argparse.Namespace) -> int:
    """Exit 0 when every sample was added, :data:`SKIPPED` when some ids were held already."""
    rows = args.rows is not None
    inputs = load_array(args.rows, default_name="rows") if rows else load_array(
        args.inputs, default_name="inputs")
    targets = load_array(args.targets, default_name="targets") if args.targets else None
    with client_of(args) as client:
        store = client.stores.get(args.id)
        first, held = args.first_id, int(store.info.get("samples") or 0)
        if args.ids is None and first is None and held:
            raise SystemExit(
                f"psgrad: error: store {args.id} holds {held} samples, numbered by their ids: "
                f"give --first-id past the ids it holds to number these after them (--first-id "
                f"{held} where they are 0 to {held - 1}), --ids for ids of your own, or the "
                "--first-id of an interrupted add to resume it")
        ids = (load_array(args.ids) if args.ids
               else np.arange(first or 0, (first or 0) + len(inputs)))
        progress = not args.no_progress
        size = args.batch_size  # 0 and below are the store's to refuse, not the default
        info = (store.add_rows(inputs, ids=ids, batch_size=16384 if size is None else size,
                               progress=progress) if rows else
                store.add(inputs, targets, ids=ids, batch_size=256 if size is None else size,
                          progress=progress))
    print(json.dumps(info))
    if info["skipped"]:
        print(f"psgrad: {info['skipped']} of {len(ids)} samples skipped: store {args.id} "
              "held their ids already", file=sys.stderr)
        return SKIPPED
    return 0


def _query(args: argparse.Namespace) -> int:
    def read(spec: str | None, name: str) -> Any:
        return load_array(spec, default_name=name) if spec else None

    with client_of(args) as client:
        found = client.stores.get(args.id).query(
            read(args.inputs, "inputs"), read(args.targets, "targets"),
            sketches=read(args.sketches, "sketches"), k=args.k, score=args.score, lam=args.lam,
            exact=True if args.exact else None, damping=args.damping, probes=args.probes)
    print(json.dumps({"ids": found.ids.tolist(), "scores": found.scores.tolist(),
                      "score": found.score, "lambda": found.lam, "exact": found.exact,
                      "damping": found.damping}))
    return 0


def _factors(args: argparse.Namespace) -> int:
    inputs = load_array(args.inputs, default_name="inputs")
    targets = load_array(args.targets, default_name="targets") if args.targets else None
    with client_of(args) as client:
        store, how = client.stores.get(args.id), {
            "batch_size": args.batch_size, "progress": not args.no_progress, "resume": args.resume}
        info = (store.fit_eigenvalues(inputs, targets, **how) if args.passes == "eigenvalues"
                else store.fit_factors(inputs, targets, eigenvalues=args.passes == "both", **how))
    print(json.dumps(info))
    return 0


def _show(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.stores.get(args.id).info))
    return 0


def _list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.stores.list()))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.stores.delete(args.id)))
    return 0
