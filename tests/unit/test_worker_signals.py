"""Warm-up ends on SIGTERM (issue 30): vLLM's engine core only records a signal that
arrives while it is being built, and `ahead` warm-up can compile for many minutes."""

import os
import signal

import pytest

from neuron_serve.worker import _stoppable


def test_sigterm_during_warm_up_raises_after_the_previous_handler_ran():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with pytest.raises(SystemExit, match="SIGTERM during warm-up"), _stoppable():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs between bytecodes
                pass
        assert seen == [signal.SIGTERM]  # vLLM's handler still records the shutdown
        handler = signal.getsignal(signal.SIGTERM)
        assert handler is not None and handler.__name__ == "<lambda>"  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
