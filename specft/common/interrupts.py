"""Whether the user pressed Ctrl-C during a command.

Python raises KeyboardInterrupt wherever SIGINT lands, but inside a native call (the
safetensors reader, for one) the library may turn it into an error of its own
("ValueError: could not determine the shape of object type ..."). A command that fails
after a SIGINT was interrupted all the same, and says so in its one line."""

from __future__ import annotations

import signal
from contextlib import contextmanager


class SigintWatch:
    seen: bool = False

    def handler(self, signum, frame):
        self.seen = True
        signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as before


@contextmanager
def watching_sigint():
    """A SigintWatch while inside; SIGINT still interrupts as Python's default does. A
    process that ignores SIGINT (a background job) keeps ignoring it."""
    watch = SigintWatch()
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield watch
        return
    signal.signal(signal.SIGINT, watch.handler)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGINT, previous)
