"""What every client command of ``psgrad`` reads: its server (the connection options and the
:class:`~psgrad.Client` they make) and its arrays (``.npy`` or ``.safetensors`` files).

The command modules (:mod:`psgrad._cli_client`, ``_cli_stores``, ``_cli_refsets``, ``_cli_dp``)
all import this one and never each other, so no two of them form an import circle.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypedDict

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from psgrad._client import Client
from psgrad._constants import ENV_API_KEY, ENV_URL
from psgrad._contract import PROJECTION_KINDS
from psgrad._errors import BadRequest

__all__ = ["client_of", "connection_options", "load_array", "names", "projection_of",
           "projection_options"]


def connection_options() -> argparse.ArgumentParser:
    """The parent parser of every command that talks to a server: ``--url``, ``--api-key``,
    ``--timeout``."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("server")
    group.add_argument("--url", help=f"the psgrad server (default: ${ENV_URL}, else "
                       "http://127.0.0.1:8000)")
    group.add_argument("--api-key", help=f"the API key (default: ${ENV_API_KEY})")
    group.add_argument("--timeout", type=float, default=300.0,
                       help="seconds per HTTP request (default: 300)")
    return parent


def client_of(args: argparse.Namespace) -> Client:
    """The client of the :func:`connection_options` a command was given."""
    return Client(base_url=args.url, api_key=args.api_key, timeout=args.timeout)


def projection_options(parser: argparse.ArgumentParser, *, dim_help: str) -> None:
    """A sketch's options, ``--projection-dim``, ``--projection-seed`` and ``--projection-kind``
    (read back by :func:`projection_of`), for the commands that make sketches."""
    parser.add_argument("--projection-dim", type=int, help=dim_help)
    parser.add_argument("--projection-seed", type=int, help="the projection's seed (default 0)")
    parser.add_argument("--projection-kind", help=f"{PROJECTION_KINDS[0]} (default) or "
                        + " or ".join(PROJECTION_KINDS[1:]))


class Projection(TypedDict):
    """The projection fields of a request, as the client takes them."""

    projection_dim: int | None
    projection_seed: int | None
    projection_kind: str | None


def projection_of(args: argparse.Namespace) -> Projection:
    """The client's keyword arguments of the :func:`projection_options` a command was given."""
    return {"projection_dim": args.projection_dim, "projection_seed": args.projection_seed,
            "projection_kind": args.projection_kind}


def names(text: str | None) -> list[str] | None:
    """A comma-separated list (``--params a,b``), or None when not given."""
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def file_of(spec: str) -> tuple[str, str]:
    """The file and the tensor name of ``file.npy`` or ``file.safetensors[:name]``."""
    path, _, name = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    return path, name


def companion(spec: str, name: str) -> np.ndarray | None:
    """The tensor ``name`` of the safetensors file ``spec`` names (with or without its own
    ``:name``), or None where it is no such file or holds none (``targets`` beside
    ``inputs``)."""
    path, _ = file_of(spec)
    if Path(path).suffix.lower() != ".safetensors" or not Path(path).is_file():
        return None
    return _tensors(path).get(name)


def _tensors(path: str) -> dict[str, np.ndarray]:
    try:
        return load_file(path)
    except SafetensorError as exc:  # not a safetensors file, or one of a dtype numpy lacks
        raise BadRequest(f"{path} is not a safetensors file numpy can read: {exc}") from None


def load_array(spec: str, *, default_name: str | None = None) -> np.ndarray:
    """An array from ``file.npy`` or ``file.safetensors[:name]``; nothing is ever unpickled."""
    path, name = file_of(spec)
    suffix = Path(path).suffix.lower()
    if suffix == ".npy":
        if name:
            raise BadRequest(f"{path} holds one array: name it without ':{name}'")
        try:
            return np.asarray(np.load(path, allow_pickle=False))
        except ValueError:  # not an .npy of numbers: numpy would have to unpickle it
            raise BadRequest(f"{path} is not a .npy file of numbers (reading it would take "
                             "unpickling it, and psgrad never reads pickles): write it with "
                             "np.save(path, array) from a numeric array") from None
    if suffix == ".safetensors":
        tensors = _tensors(path)
        if name:
            if name not in tensors:
                raise BadRequest(f"{path} has no tensor {name!r}; it has: {', '.join(tensors)}")
            return tensors[name]
        if default_name in tensors:
            return tensors[default_name]
        if len(tensors) == 1:
            return next(iter(tensors.values()))
        raise BadRequest(f"{path} holds several tensors ({', '.join(tensors)}): pick one with "
                         f"{path}:NAME")
    raise BadRequest(f"{path}: read .npy or .safetensors files only (never pickles)")
