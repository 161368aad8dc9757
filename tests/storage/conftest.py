import pytest

from logbus.storage import LogConfig, PartitionLog


class FakeClock:
    """A settable millisecond clock, passed to the log instead of wall time."""

    def __init__(self, now_ms: int = 1_700_000_000_000):
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def open_log(tmp_path, clock):
    """Open (or reopen) a partition log in a temp dir with the given config dict."""
    opened = []

    def _open(config=None, directory=None):
        log = PartitionLog(str(directory or tmp_path / "topic-0"), LogConfig.from_dict(config), clock_ms=clock)
        opened.append(log)
        return log

    yield _open
    for log in opened:
        if not log._closed:
            log.close()
