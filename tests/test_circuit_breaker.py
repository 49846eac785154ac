"""An upstream that keeps failing is left alone for a while: the circuit breaker opens after
`threshold` failures with no success between, refuses everything during the cool-down, then
lets exactly one trial through, which closes it on success and opens it again on failure. A
threshold of 0 turns it off. Every change of state, and only a change, is reported.

Failures without a key (the upstream not reached at all) count each time; a file (a key) that
fails counts once in a run however often it fails, and rests: it is not to be asked again for
`key_rest_s`, unless it is answered meanwhile."""

from __future__ import annotations

import logging

import pytest

from proxy.metrics import BreakerState
from proxy.sources.breaker import MAX_RESTING_KEYS, CircuitBreaker

CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def changes() -> list[BreakerState]:
    return []


def breaker(clock: Clock, changes: list[BreakerState], threshold: int = 3,
            cooldown_s: float = 10.0, key_rest_s: float = 0.0) -> CircuitBreaker:
    return CircuitBreaker(threshold, cooldown_s, changes.append, clock=clock,
                          key_rest_s=key_rest_s)


def test_starts_closed_and_says_so(clock: Clock, changes: list[BreakerState]) -> None:
    b = breaker(clock, changes)
    assert b.state is CLOSED and changes == [CLOSED]
    assert all(b.allow() for _ in range(100))  # closed: no limit on concurrent requests


def test_opens_on_the_thresholdth_consecutive_failure(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=3)
    assert b.failure() is False and b.failure() is False
    assert b.state is CLOSED and b.allow()
    assert b.failure() is True  # this one opened it
    assert b.state is OPEN and changes == [CLOSED, OPEN]
    assert not b.allow()


def test_a_success_in_between_starts_the_count_again(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=3)
    for _ in range(5):
        b.failure()
        b.failure()
        b.success()
    assert b.state is CLOSED and changes == [CLOSED]


def test_open_refuses_everything_until_the_cool_down_is_over(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=1, cooldown_s=10)
    b.failure()
    clock.now += 9.99
    assert not b.allow() and b.state is OPEN
    clock.now += 0.01
    assert b.allow()  # cool-down over: a trial
    assert b.state is HALF_OPEN and changes == [CLOSED, OPEN, HALF_OPEN]


def test_half_open_lets_exactly_one_trial_through(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=1, cooldown_s=10)
    b.failure()
    clock.now += 60
    assert b.allow()
    clock.now += 60  # however long the trial takes
    assert [b.allow() for _ in range(10)] == [False] * 10
    assert b.state is HALF_OPEN


def test_a_successful_trial_closes_it(clock: Clock, changes: list[BreakerState]) -> None:
    b = breaker(clock, changes, threshold=2, cooldown_s=10)
    b.failure()
    b.failure()
    clock.now += 10
    assert b.allow()
    b.success()
    assert b.state is CLOSED and changes == [CLOSED, OPEN, HALF_OPEN, CLOSED]
    assert all(b.allow() for _ in range(10))
    assert b.failure() is False  # a full run of failures is needed to open it again
    assert b.state is CLOSED
    assert b.failure() is True and b.state is OPEN


def test_a_failed_trial_opens_it_again_for_a_new_cool_down(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=3, cooldown_s=10)
    for _ in range(3):
        b.failure()
    clock.now += 10
    assert b.allow()
    clock.now += 5
    assert b.failure() is True  # one failed trial is enough, whatever the threshold
    assert b.state is OPEN and changes == [CLOSED, OPEN, HALF_OPEN, OPEN]
    clock.now += 9.99  # the cool-down counts from the failed trial
    assert not b.allow()
    clock.now += 0.01
    assert b.allow() and b.state is HALF_OPEN


def test_a_late_failure_while_open_neither_reopens_nor_reports(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=1)
    assert b.failure() is True
    assert b.failure() is False  # a request let through before it opened, failing late
    assert b.state is OPEN and changes == [CLOSED, OPEN]


def test_threshold_zero_never_opens(clock: Clock, changes: list[BreakerState]) -> None:
    b = breaker(clock, changes, threshold=0)
    for _ in range(1000):
        assert b.allow()
        assert b.failure() is False
    assert b.state is CLOSED and changes == [CLOSED]


def test_each_change_is_logged_once_with_the_name_and_the_last_failure(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    b = CircuitBreaker(2, 10.0, lambda _: None, clock=clock, name="http://up.example")
    with caplog.at_level(logging.INFO, logger="proxy.sources.breaker"):
        b.failure("http://up.example: answered 503", key="/buildid/aa/debuginfo")
        b.failure("http://up.example: ConnectionResetError", key="/buildid/bb/debuginfo")
        b.failure("http://up.example: ConnectionResetError")  # still open: no new line
        assert not b.allow()
        clock.now += 10
        assert b.allow()
        b.failure("http://up.example: no response in time")  # the trial failed
        clock.now += 10
        assert b.allow()
        b.success()
        b.success()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO, logging.WARNING,
                                             logging.INFO, logging.WARNING]
    assert all("http://up.example" in text for _, text in lines)
    opened, _, reopened, _, closed = (text for _, text in lines)
    assert "open" in opened and "2 different files failed with no success" in opened
    assert "ConnectionResetError" in opened and "answered 503" not in opened
    assert "trial failed" in reopened and "no response in time" in reopened
    assert "closed" in closed


@pytest.mark.parametrize("threshold", [3, 0])
def test_an_answer_sent_before_a_rest_was_asked_leaves_it_open(
    clock: Clock, changes: list[BreakerState], threshold: int
) -> None:
    """A 404 to a request made before another's 429 asked for a rest says nothing against
    the rest: the breaker stays open (as the status page and metrics show it) until its end."""
    b = breaker(clock, changes, threshold=threshold, cooldown_s=10)
    assert b.rest(120, "answered 429") is True
    b.success()
    assert b.state is OPEN and not b.allow()
    clock.now += 120
    assert b.allow()  # its end: a trial (with a threshold), or closed (without)
    b.success()
    assert b.state is CLOSED
    assert changes == [CLOSED, OPEN, HALF_OPEN, CLOSED] if threshold else [CLOSED, OPEN, CLOSED]


def test_one_file_failing_again_and_again_never_opens_it(
    clock: Clock, changes: list[BreakerState]
) -> None:
    """A client that knows one file the upstream fails for, asking for it as often as it
    likes (and symgate's own retries of it), says nothing of the upstream's other files."""
    b = breaker(clock, changes, threshold=2)
    for _ in range(1000):
        assert b.failure("answered 500", key="/buildid/aa/debuginfo") is False
    assert b.state is CLOSED and changes == [CLOSED] and b.allow()


def test_threshold_different_files_open_it(clock: Clock, changes: list[BreakerState]) -> None:
    b = breaker(clock, changes, threshold=3)
    for bad in ("aa", "bb", "aa", "bb", "aa"):
        assert b.failure(key=f"/buildid/{bad}/debuginfo") is False
    assert b.failure(key="/buildid/cc/debuginfo") is True
    assert b.state is OPEN and changes == [CLOSED, OPEN]


def test_a_success_between_forgets_the_files_that_failed(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=3)
    b.failure(key="aa")
    b.failure(key="bb")
    b.success(key="dd")  # another client's file, served
    b.failure(key="aa")
    b.failure(key="cc")
    assert b.state is CLOSED
    assert b.failure(key="ee") is True


def test_not_reaching_the_upstream_counts_each_time_and_with_the_files(
    clock: Clock, changes: list[BreakerState]
) -> None:
    """Refused, unresolvable: every file would have failed so. With a file's failures, the
    run is as long as both together."""
    b = breaker(clock, changes, threshold=3)
    b.failure("ClientConnectorError")
    b.failure("answered 500", key="aa")
    b.failure("answered 500", key="aa")
    assert b.state is CLOSED
    assert b.failure("ClientConnectorError") is True


def test_a_failed_file_rests_until_its_time_is_over(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=0, key_rest_s=10)  # whatever the breaker does
    b.failure("answered 500", key="aa")
    assert b.key_rest("aa") == (10, "answered 500")
    assert b.key_rest("bb") is None  # another file is asked
    clock.now += 9.5
    assert b.key_rest("aa") == (0.5, "answered 500")
    b.failure("no response in time", key="aa")  # asked again (another upstream's turn, say)
    assert b.key_rest("aa") == (10, "no response in time")  # from the last failure
    clock.now += 10
    assert b.key_rest("aa") is None
    assert b.allow() and b.state is CLOSED


def test_only_the_files_own_answer_ends_its_rest(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, key_rest_s=10)
    b.failure("answered 500", key="aa")
    b.success(key="bb")
    b.success()
    assert b.key_rest("aa") is not None
    b.success(key="aa")  # its 404, or its 200 (a request sent before it failed)
    assert b.key_rest("aa") is None


def test_not_reaching_the_upstream_rests_no_file(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=0, key_rest_s=10)
    b.failure("ClientConnectorError")
    assert b.key_rest("aa") is None and b.key_rest("") is None


def test_no_rest_without_a_rest_time(clock: Clock, changes: list[BreakerState]) -> None:
    b = breaker(clock, changes, key_rest_s=0)
    b.failure("answered 500", key="aa")
    assert b.key_rest("aa") is None


def test_the_files_resting_are_bounded_oldest_forgotten_first(
    clock: Clock, changes: list[BreakerState]
) -> None:
    b = breaker(clock, changes, threshold=0, key_rest_s=10)
    for i in range(MAX_RESTING_KEYS + 1):
        b.failure(key=f"k{i}")
    assert b.key_rest("k0") is None
    assert b.key_rest("k1") is not None and b.key_rest(f"k{MAX_RESTING_KEYS}") is not None
