"""The ``.pt2`` zip, opened under limits: only the entries ``torch.export.save`` writes.

A client's archive is read with :mod:`zipfile` and nothing else. Every entry name is matched
against the fixed layout of a torch.export archive (one program named ``model``); anything else
(``data/aotinductor/``, ``extra/``, opaque or custom objects, pickled payloads, a second
program) is refused by name before a byte of it is read. The pickled sample inputs that
torch always writes are accepted as a name and never opened. JSON entries are parsed with
:func:`json.loads` only, under a size cap. A payload is read once, into memory of its own that
its tensors then view (copying GPT-2 small's 500 MB twice cost 0.3 s and 500 MB more).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from psgrad._errors import InvalidArchive, RefusedProgram, TooLarge
from service.config import raise_setting

ROOT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
WEIGHT_RE = re.compile(r"data/weights/(weight_[0-9]{1,6})")
CONSTANT_RE = re.compile(r"data/constants/(tensor_[0-9]{1,6})")
MODEL_JSON = "models/model.json"
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"  # a pickle: accepted as a name, never read
FIXED = {"archive_format": b"pt2", "archive_version": b"0", "byteorder": b"little"}
IGNORED = {".data/version", ".data/serialization_id", SAMPLE_INPUTS}
JSON_ENTRIES = (MODEL_JSON, WEIGHTS_CONFIG, CONSTANTS_CONFIG)
REFUSED_PREFIXES = {  # what torch.export.load would execute or unpickle, named in the refusal
    "data/aotinductor/": "a compiled shared library (torch would dlopen it)",
    "data/constants/custom_obj_": "a pickled custom object",
    "data/constants/opaque_obj_": "a pickled opaque object",
    "data/sample_inputs/": "pickled sample inputs other than the one torch writes",
    "data/executorch/": "an ExecuTorch payload",
    "data/mtia": "an MTIA payload",
    "xl_model_weights/": "externally stored weights",
    "extra/": "extra files",
    "models/": "a second program (one archive holds one program named 'model')",
}


SLACK = 64 << 20  # what an archive may unpack to beyond PSGRAD_MAX_WEIGHT_BYTES: its JSON
FIXED_LIMIT = ("a fixed limit of psgrad's archive reader, far above what torch.export.save "
               "writes: no setting raises it")


@dataclass(frozen=True)
class ArchiveLimits:
    """How much of a client's zip psgrad agrees to look at."""

    max_entries: int = 20_000
    max_unpacked_bytes: int = 600 * 1024 * 1024
    max_json_bytes: int = 64 * 1024 * 1024
    max_ratio: float = 200.0  # unpacked / packed per compressed entry: a zip bomb is refused


@dataclass(frozen=True)
class Archive:
    """The parts of an archive psgrad reads: three JSON documents and raw payloads by name."""

    program: dict[str, Any]
    weights_config: dict[str, Any]
    constants_config: dict[str, Any]
    weights: dict[str, torch.Tensor]  # "weight_3" -> raw little-endian bytes (uint8)
    constants: dict[str, torch.Tensor]  # "tensor_0" -> raw little-endian bytes (uint8)


def read_archive(data: bytes | IO[bytes], limits: ArchiveLimits) -> Archive:
    """Open ``data`` (bytes, or a file open for reading) as a torch.export archive; every
    surprise is a 4xx naming the entry."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise InvalidArchive(f"the body is not a readable zip archive ({exc}); send the file "
                             "torch.export.save wrote") from None
    if len(infos) > limits.max_entries:
        raise TooLarge(f"the archive has {len(infos)} entries; the limit is {limits.max_entries} "
                       f"({FIXED_LIMIT})", limit=limits.max_entries)
    entries = _classify(infos, limits)
    with zf:
        blobs = {rel: _read(zf, info, limits) for rel, info in entries.items()
                 if rel not in IGNORED}
    for rel, want in FIXED.items():
        if _bytes(blobs.get(rel)).strip() != want:
            raise InvalidArchive(f"entry '{rel}' must hold {want.decode()!r}: this is not a "
                                 "torch.export archive psgrad reads", entry=rel)
    docs = {rel: _json(rel, blobs.get(rel)) for rel in JSON_ENTRIES}
    return Archive(
        program=docs[MODEL_JSON], weights_config=docs[WEIGHTS_CONFIG],
        constants_config=docs[CONSTANTS_CONFIG],
        weights={m.group(1): b for rel, b in blobs.items() if (m := WEIGHT_RE.fullmatch(rel))},
        constants={m.group(1): b for rel, b in blobs.items()
                   if (m := CONSTANT_RE.fullmatch(rel))},
    )


def _classify(infos: list[zipfile.ZipInfo], limits: ArchiveLimits) -> dict[str, zipfile.ZipInfo]:
    """Entry names relative to the one root folder; sizes summed before anything is read."""
    entries: dict[str, zipfile.ZipInfo] = {}
    roots: set[str] = set()
    total = 0
    for info in infos:
        name = info.filename
        root, _, rel = name.partition("/")
        if not ROOT_RE.fullmatch(root) or not rel or name.endswith("/"):
            raise InvalidArchive(f"unexpected entry {name[:120]!r}: a torch.export archive "
                                 "holds files under one folder", entry=name[:120])
        roots.add(root)
        for prefix, what in REFUSED_PREFIXES.items():
            if rel.startswith(prefix) and rel not in (SAMPLE_INPUTS, MODEL_JSON):
                raise RefusedProgram(f"entry '{name[:120]}' is {what}; psgrad never loads "
                                     "code, pickles or libraries from a client", entry=name[:120])
        known = (rel in FIXED or rel in IGNORED or rel in JSON_ENTRIES
                 or WEIGHT_RE.fullmatch(rel) or CONSTANT_RE.fullmatch(rel))
        if not known:
            raise RefusedProgram(f"unexpected entry '{name[:120]}': psgrad reads only the "
                                 "entries torch.export.save writes", entry=name[:120])
        if rel in entries:
            raise InvalidArchive(f"entry '{name[:120]}' appears twice", entry=name[:120])
        if info.flag_bits & 0x1:
            raise InvalidArchive(f"entry '{name[:120]}' is encrypted", entry=name[:120])
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise InvalidArchive(f"entry '{name[:120]}' uses an unsupported compression",
                                 entry=name[:120])
        if (info.compress_type != zipfile.ZIP_STORED
                and info.file_size > limits.max_ratio * max(info.compress_size, 1)):
            raise TooLarge(f"entry '{name[:120]}' unpacks {info.file_size} bytes from "
                           f"{info.compress_size}: refused as a zip bomb (more than "
                           f"{limits.max_ratio:g} to 1; {FIXED_LIMIT})", entry=name[:120])
        total += info.file_size if rel not in IGNORED else 0
        entries[rel] = info
    if len(roots) > 1:
        shown = ", ".join(sorted(roots))[:200]
        raise InvalidArchive(f"the archive has several top folders ({shown})")
    if total > limits.max_unpacked_bytes:
        raise TooLarge(f"the archive unpacks to {total} bytes; the limit is "
                       f"{limits.max_unpacked_bytes}, 64 MiB more than the weights may take: "
                       f"{raise_setting('max_weight_bytes', limits.max_unpacked_bytes - SLACK)}",
                       limit=limits.max_unpacked_bytes)
    missing = [rel for rel in (*FIXED, *JSON_ENTRIES) if rel not in entries]
    if missing:
        raise InvalidArchive(f"the archive lacks {', '.join(missing)}: send the file "
                             "torch.export.save wrote", missing=missing)
    return entries


CHUNK = 1 << 20  # what zipfile reads (and checks the CRC of) at a time


def _read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: ArchiveLimits) -> torch.Tensor:
    """The declared size, read in place (and one byte more, to catch a lying header)."""
    rel = info.filename.partition("/")[2]
    cap = limits.max_json_bytes if rel in JSON_ENTRIES else limits.max_unpacked_bytes
    if info.file_size > cap:
        how = FIXED_LIMIT if rel in JSON_ENTRIES else \
            raise_setting("max_weight_bytes", limits.max_unpacked_bytes - SLACK)
        raise TooLarge(f"entry '{info.filename[:120]}' is {info.file_size} bytes; the limit is "
                       f"{cap} ({how})", entry=info.filename[:120], limit=cap)
    blob = torch.empty(info.file_size, dtype=torch.uint8)  # not zeroed: each byte is read in
    view, got = blob.numpy().data, 0
    try:
        with zf.open(info) as f:
            read = cast(zipfile.ZipExtFile, f).readinto
            while got < len(blob) and (n := read(view[got:got + CHUNK])):
                got += n
            extra = f.read(1)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, RuntimeError) as exc:
        raise InvalidArchive(f"entry '{info.filename[:120]}' cannot be read ({exc})"[:300],
                             entry=info.filename[:120]) from None
    if got != info.file_size or extra:
        raise InvalidArchive(f"entry '{info.filename[:120]}' is not the size its header says",
                             entry=info.filename[:120])
    return blob


def _bytes(blob: torch.Tensor | None) -> bytes:
    return b"" if blob is None else blob.numpy().tobytes()


def _json(rel: str, blob: torch.Tensor | None) -> dict[str, Any]:
    try:
        doc = json.loads(_bytes(blob))
    except (ValueError, RecursionError) as exc:
        raise InvalidArchive(f"entry '{rel}' is not valid JSON ({exc})"[:300], entry=rel) from None
    if not isinstance(doc, dict):
        raise InvalidArchive(f"entry '{rel}' must be a JSON object", entry=rel)
    return doc
