"""A ``.pt2`` archive's size, refused in the api before any child process starts.

Checking an archive in its child process costs seconds before it reaches a limit (a fresh
interpreter imports torch, then the archive is unpacked, parsed and its tensors copied): a GPT-2
refused for its parameters took 13 to 19 s. What the zip's directory and the small weights
config already say is checked here, in well under a second and with bounded work: the number
of entries, the bytes the tensors unpack to, and the parameters the weights config declares.
Anything this reader cannot make sense of is left to the child, which refuses it with the
precise error; this only ever refuses what is too large.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from typing import IO, Any

from service.export.archive import WEIGHTS_CONFIG, ArchiveLimits
from service.export.module import ExportLimits, check_size

MAX_CONFIG_BYTES = 8 << 20  # a weights config larger than this is left to the child


def precheck(data: bytes | IO[bytes], limits: ExportLimits) -> None:
    """Raise ``TooLarge`` when the archive's directory or weights config shows it is (its
    bytes, or a file holding them, which is left open)."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError):
        return  # the child says what is wrong with it
    with zf:
        if len(infos) > limits.archive.max_entries:
            return  # refused by the child's first check, before anything is unpacked
        tensors = sum(i.file_size for i in infos if _rel(i).startswith(("data/weights/weight_",
                                                                       "data/constants/tensor_")))
        config = next((i for i in infos if _rel(i) == WEIGHTS_CONFIG), None)
        params = _parameters(zf, config, limits.archive) if config is not None else 0
    check_size(params, tensors, limits)


def _rel(info: zipfile.ZipInfo) -> str:
    return info.filename.partition("/")[2]


def _parameters(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: ArchiveLimits) -> int:
    """The parameters the weights config declares (a payload read by several names counts
    once: tied weights); 0 when the config is not one this reader makes sense of."""
    if info.file_size > MAX_CONFIG_BYTES or (
            info.compress_type != zipfile.ZIP_STORED
            and info.file_size > limits.max_ratio * max(info.compress_size, 1)):
        return 0
    try:
        with zf.open(info) as f:
            doc = json.loads(f.read(MAX_CONFIG_BYTES + 1))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, RuntimeError, RecursionError):
        return 0
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        return 0
    counted: dict[Any, int] = {}
    for meta in config.values():
        if not isinstance(meta, dict) or meta.get("is_param") is not True:
            continue
        sizes = (meta.get("tensor_meta") or {}).get("sizes") if isinstance(
            meta.get("tensor_meta"), dict) else None
        numbers: list[Any] = [s.get("as_int") for s in sizes if isinstance(s, dict)] \
            if isinstance(sizes, list) else []
        if not numbers or not all(type(n) is int and n >= 0 for n in numbers):
            continue
        path = meta.get("path_name")
        if isinstance(path, str):
            counted[path] = max(counted.get(path, 0), math.prod(numbers))
    return sum(counted.values())
