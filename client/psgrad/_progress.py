"""A progress bar for chunked requests: tqdm when it is installed, else one line on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Called as ``progress(done, total)`` by the chunking plan; ``close()`` ends the line.

    Args:
        desc: the label in front of the bar.
        stream: where the plain bar is drawn (stderr by default; tqdm picks its own).
        use_tqdm: use tqdm if it can be imported (never required).
    """

    def __init__(
        self, desc: str = "psgrad", *, stream: TextIO | None = None, use_tqdm: bool = True
    ) -> None:
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._tqdm: Any = None
        if use_tqdm and stream is None:
            try:
                from tqdm.auto import tqdm  # optional; not a dependency
            except ImportError:
                tqdm = None
            self._tqdm = tqdm
        self._start = time.monotonic()
        self._done = 0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if self._tqdm is not None:
            if self._bar is None or self._bar.total != total:
                if self._bar is not None:
                    self._bar.close()
                self._bar = self._tqdm(  # "done/total samples", as the plain bar reads
                    total=total, desc=self.desc, unit="sample",
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} samples "
                    "[{elapsed}<{remaining}, {rate_fmt}]")
            self._bar.update(done - self._bar.n)
            return
        if done < self._done:  # the plan started again with smaller chunks
            self._start = time.monotonic()
        self._done = done
        width = 30
        filled = int(width * done / total) if total else width
        rate = done / max(time.monotonic() - self._start, 1e-9)
        self.stream.write(
            f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] "
            f"{done}/{total} samples ({rate:,.0f}/s)"
        )
        self.stream.flush()
        self._drawn = True

    def label(self, desc: str) -> None:
        """A new label in front of the bar (what the work found so far)."""
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._drawn:
            self.stream.write("\n")
            self.stream.flush()
