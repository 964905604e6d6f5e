"""Progress that reads well wherever it is written.

On a terminal a tqdm bar redraws in place. In a file (a Slurm log, ``cmd > log 2>&1``, CI) every redraw is
appended: a quickstart log held thousands of frames on one line. Outside a TTY, progress is therefore one plain
line every ``DINOPIPE_PROGRESS_EVERY`` seconds (default 30) and one at the end, with the count, rate and ETA:

    embed task 0/4: 12,288/50,000 img (24.6%), 410.2 img/s, ETA 0:01:32

Every long loop of training, curation and eval asks :func:`progress` for its reporter; callers use the tqdm
subset both forms share (``update``, ``set_postfix``, ``close``, iteration, ``with``).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Callable, Iterable, TextIO

EVERY_ENV = "DINOPIPE_PROGRESS_EVERY"
DEFAULT_EVERY_S = 30.0


def _every_s() -> float:
    raw = os.environ.get(EVERY_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_EVERY_S
    except ValueError:
        return DEFAULT_EVERY_S


def _fmt_n(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


class LineProgress:
    """A tqdm look-alike that prints a line at most every ``every_s`` seconds (and one at close)."""

    def __init__(self, iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, every_s: float | None = None, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._start_n = initial
        self.every_s = _every_s() if every_s is None else every_s
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._t0 = self._last = clock()
        self._postfix = ""
        self._closed = False
        self._printed_n: int | None = None

    def line(self) -> str:
        elapsed = max(self._clock() - self._t0, 1e-9)
        rate = (self.n - self._start_n) / elapsed
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            s = f"{head}{_fmt_n(self.n)}/{_fmt_n(self.total)} {self.unit} ({100.0 * self.n / self.total:.1f}%)"
        else:
            s = f"{head}{_fmt_n(self.n)} {self.unit}"
        s += f", {rate:,.1f} {self.unit}/s"
        if self.total and rate > 0 and self.n < self.total:
            s += f", ETA {timedelta(seconds=round((self.total - self.n) / rate))}"
        elif self.n >= (self.total or float("inf")):
            s += f", done in {timedelta(seconds=round(elapsed))}"
        return s + (f", {self._postfix}" if self._postfix else "")

    def _emit(self) -> None:
        self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._last, self._printed_n = self._clock(), self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._clock() - self._last >= self.every_s:
            self._emit()

    def set_postfix(self, **kw) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._printed_n != self.n:  # the final count, unless the last line already said it
                self._emit()

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Off:
    """What a disabled reporter is: nothing printed, the iterable passed through."""

    def __init__(self, iterable: Iterable | None = None) -> None:
        self.iterable = iterable

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kw) -> None:
        pass

    def close(self) -> None:
        pass

    def __iter__(self):
        return iter(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             disable: bool = False, initial: int = 0, stream: TextIO | None = None, mininterval: float = 2.0):
    """A progress reporter: a tqdm bar on a terminal, :class:`LineProgress` anywhere else, nothing if disabled."""
    if disable:
        return _Off(iterable)
    stream = stream if stream is not None else sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream,
                    mininterval=mininterval)
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, stream=stream)
