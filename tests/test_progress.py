"""Long work reports its progress in a log file too, not only on a terminal."""

import logging

from specft.common.progress import progress_bar


def test_progress_off_a_terminal_is_logged_with_counts_and_rate(caplog):
    # pytest's stderr is not a terminal: the bar goes to the log.
    with caplog.at_level(logging.INFO, logger="specft.progress"):
        with progress_bar(6, "regenerate r0", "conv", initial=2, interval=0) as bar:
            for _ in range(4):
                bar.update(1)
                bar.set_postfix_str("45.1 tok/s")
    lines = [r.getMessage() for r in caplog.records if r.name == "specft.progress"]
    assert lines[0].startswith("regenerate r0:") and "2/6" in lines[0]  # a resumed job starts where it was
    assert "6/6" in lines[-1] and "conv/s" in lines[-1] and "45.1 tok/s" in lines[-1], lines
    assert all("\r" not in line for line in lines)
    assert all(a != b for a, b in zip(lines, lines[1:]))  # closing redraws nothing new


def test_progress_logs_at_most_once_per_interval(caplog):
    with caplog.at_level(logging.INFO, logger="specft.progress"):
        with progress_bar(1000, "cache r0", "tok", interval=3600) as bar:
            for _ in range(1000):
                bar.update(1)
                bar.set_postfix_str("45.1 tok/s", refresh=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "specft.progress"]
    # the first draw and the final one; none of the 1000 updates in between
    assert len(lines) == 2 and "0/1000" in lines[0] and "1000/1000" in lines[1], lines
