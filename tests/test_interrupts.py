"""A Ctrl-C that a native library turns into an error of its own is still a Ctrl-C."""

import os
import signal

import pytest

from specft.common.interrupts import watching_sigint


def _library_call_interrupted():
    """What the safetensors reader did under a SIGINT: the KeyboardInterrupt became a
    ValueError (tests/test_bad_inputs.py's Ctrl-C test met it)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs at the next bytecode boundary
            pass
    except KeyboardInterrupt:
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None


def test_a_sigint_turned_into_another_error_is_seen():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a command starts
    try:
        with watching_sigint() as sigint:
            with pytest.raises(ValueError):
                _library_call_interrupted()
        assert sigint.seen
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)


def test_no_sigint_is_not_seen_and_ignored_sigint_stays_ignored():
    with watching_sigint() as sigint:
        pass
    assert not sigint.seen
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with watching_sigint():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
