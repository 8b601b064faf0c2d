"""Progress of long work (regeneration, stage 1, eval) on a terminal and in a log file.

On a terminal a tqdm bar redraws in place. When stderr is not a terminal (``nohup``, a
scheduler's log, CI), tqdm's bar would be either hidden (``disable=None``) or a stream of
carriage returns; there the same bar is logged as one line every ``interval`` seconds and
once at the end, so a long job's log still says how far it is, how fast and how long is left.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

log = logging.getLogger("specft.progress")

LOG_INTERVAL_S = 60.0


class _LogLines:
    """A file for tqdm that logs each redraw as one line (a redraw that changed nothing,
    such as closing right after the last update, is not logged again)."""

    def __init__(self) -> None:
        self.last = ""

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        if line and line != self.last:
            log.info(line)
            self.last = line

    def flush(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str, initial: int = 0, interval: float = LOG_INTERVAL_S) -> tqdm:
    """A tqdm bar for ``total`` units: redrawn on a terminal, logged every ``interval``
    seconds (and when it closes) otherwise. Set a postfix with ``refresh=False``: a
    refreshing one would log a line each time."""
    if sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, unit=unit)
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=_LogLines(), ascii=True, ncols=100,
                mininterval=interval, maxinterval=max(interval, 1.0), miniters=1)
