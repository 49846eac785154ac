"""Circuit breaker: stop asking an upstream that keeps failing, then try it again later; and
stop asking it for a file that keeps failing there, for a while, whatever the breaker says.

What opens the breaker is evidence about the upstream, not about one file: a client may know a
file the upstream answers 500 for, or a slow path that times out, and ask for it as often as
it likes. Such a file's failures count once in a run of failures, however often it fails, and
while it rests (`key_rest_s`) it is not asked of the upstream at all. A failure to connect to
the upstream at all says the same of every file, so each one counts.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from proxy.headers import MAX_RETRY_AFTER_S
from proxy.metrics import BreakerState

log = logging.getLogger(__name__)


# The most files a breaker remembers resting at once: a flood of distinct failing files
# must not grow memory without end (the oldest rest is forgotten first).
MAX_RESTING_KEYS = 10_000


@dataclass(frozen=True, slots=True)
class KeyRest:
    """A file not asked of the upstream again until `until`, after it failed with `reason`."""

    until: float
    reason: str


class CircuitBreaker:
    """Opens after `threshold` failures with no success between, each of a different file (a
    `key`) or a failure to reach the upstream at all (no key); after `cooldown_s` one trial is
    let through.

    Only transport failures (connect errors, resets, timeouts, 5xx) count: a 404 is an answer.
    Also open while the upstream rests as it asked (rest): its Retry-After on a 429 or 503.
    A file that failed rests for `key_rest_s` (0: never), ended early by its success.
    """

    def __init__(
        self,
        threshold: int,
        cooldown_s: float,
        on_change: Callable[[BreakerState], None],
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
        key_rest_s: float = 0.0,
    ) -> None:
        # With a name, each change of state is logged once: an operator whose cold misses all
        # get 502 must be able to read when the breaker opened, and why.
        self._name = name
        self.last_failure = ""
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._on_change = on_change
        self._clock = clock
        # The run of failures since the last success: the files that failed in it, once each,
        # and how many times the upstream could not be reached.
        self._failed_keys: set[str] = set()
        self._unreachable = 0
        self._key_rest_s = key_rest_s
        self._resting: OrderedDict[str, KeyRest] = OrderedDict()
        self._opened_at = 0.0
        self._trial_in_flight = False
        self._rest_until = 0.0
        self.state = BreakerState.CLOSED
        on_change(self.state)

    def _set(self, state: BreakerState) -> None:
        if state is not self.state:
            before, self.state = self.state, state
            self._on_change(state)
            if self._name:
                self._log(before, state)

    def _log(self, before: BreakerState, state: BreakerState) -> None:
        if state is BreakerState.OPEN:
            log.warning("upstream %s: circuit breaker open (%s), next trial in %g s; "
                        "last failure: %s", self._name,
                        "the trial failed" if before is BreakerState.HALF_OPEN
                        else self._run_told(),
                        self._cooldown_s, self.last_failure or "unknown")
        elif state is BreakerState.HALF_OPEN:
            log.info("upstream %s: circuit breaker half-open, letting one trial through",
                     self._name)
        else:
            log.warning("upstream %s: circuit breaker closed, the upstream answers again",
                        self._name)

    def _run_told(self) -> str:
        files, unreachable = len(self._failed_keys), self._unreachable
        parts = ([f"{files} different files failed"] if files else []) + (
            [f"{unreachable} times unreachable"] if unreachable else [])
        return " and ".join(parts) + " with no success between"

    def allow(self) -> bool:
        if self._clock() < self._rest_until:
            return False
        if self._threshold == 0 and self.state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)  # its rest is over, and failures are not counted
        if self._threshold == 0 or self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() - self._opened_at < self._cooldown_s:
                return False
            self._set(BreakerState.HALF_OPEN)
        if self._trial_in_flight:
            return False
        self._trial_in_flight = True
        return True

    def abandon(self) -> None:
        """The trial was given up before any answer (cancelled: another upstream won a race,
        or shutdown): the next request may try again, or the breaker would never close."""
        self._trial_in_flight = False

    def rest(self, seconds: float, reason: str) -> bool:
        """The upstream asked not to be asked again for `seconds` (Retry-After on a 429 or a
        503): open until then (a trial at its end), whatever the threshold: counting failures
        may be off, answering a server's request is not. True when this opened the breaker."""
        now = self._clock()
        self.last_failure = reason
        self._trial_in_flight = False
        self._rest_until = max(self._rest_until, now + min(seconds, MAX_RETRY_AFTER_S))
        self._opened_at = self._rest_until - self._cooldown_s  # the cooldown ends with it
        opened = self.state is not BreakerState.OPEN
        self._set(BreakerState.OPEN)
        return opened

    def resting_s(self) -> float:
        """How much longer the upstream asked not to be asked; 0 when it did not."""
        return max(self._rest_until - self._clock(), 0.0)

    def key_rest(self, key: str) -> tuple[float, str] | None:
        """How much longer `key` rests after its failure, and that failure; None: ask."""
        rest = self._resting.get(key)
        if rest is None:
            return None
        left = rest.until - self._clock()
        if left <= 0:
            del self._resting[key]
            return None
        return left, rest.reason

    def success(self, key: str | None = None) -> None:
        """Any answer (a 404, a 401 too): the upstream is there. `key`: the file answered,
        whose rest, if it had one, is over."""
        self._failed_keys.clear()
        self._unreachable = 0
        if key is not None:
            self._resting.pop(key, None)
        self._trial_in_flight = False
        if self._clock() < self._rest_until:
            # The answer to a request sent before the upstream asked for its rest, which
            # still holds: shown closed, it would be taken for asked meanwhile.
            return
        self._set(BreakerState.CLOSED)

    def failure(self, reason: str = "", key: str | None = None) -> bool:
        """Record a failure of the file `key`, or (None) to reach the upstream at all; True
        when this one opened the breaker."""
        self.last_failure = reason
        self._trial_in_flight = False
        if key is not None:
            self._rest_key(key, reason)
        if not self._threshold or self.state is BreakerState.OPEN:
            return False  # not counted, or a request let through before it opened, late
        if key is None:
            self._unreachable += 1
        else:
            self._failed_keys.add(key)  # at most `threshold` of them: then it opens
        if (self.state is BreakerState.HALF_OPEN
                or len(self._failed_keys) + self._unreachable >= self._threshold):
            self._opened_at = self._clock()
            self._set(BreakerState.OPEN)
            return True
        return False

    def _rest_key(self, key: str, reason: str) -> None:
        if not self._key_rest_s:
            return
        self._resting.pop(key, None)
        self._resting[key] = KeyRest(self._clock() + self._key_rest_s, reason)
        while len(self._resting) > MAX_RESTING_KEYS:
            self._resting.popitem(last=False)
