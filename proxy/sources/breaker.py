"""Circuit breaker: stop asking an upstream that keeps failing, then try it again later."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from proxy.headers import MAX_RETRY_AFTER_S
from proxy.metrics import BreakerState

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Opens after `threshold` consecutive failures; after `cooldown_s` one trial is let through.

    Only transport failures (connect errors, resets, timeouts, 5xx) count: a 404 is an answer.
    Also open while the upstream rests as it asked (rest): its Retry-After on a 429 or 503.
    """

    def __init__(
        self,
        threshold: int,
        cooldown_s: float,
        on_change: Callable[[BreakerState], None],
        clock: Callable[[], float] = time.monotonic,
        name: str = "",
    ) -> None:
        # With a name, each change of state is logged once: an operator whose cold misses all
        # get 502 must be able to read when the breaker opened, and why.
        self._name = name
        self.last_failure = ""
        self._threshold = threshold
        self._cooldown_s = cooldown_s
        self._on_change = on_change
        self._clock = clock
        self._failures = 0
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
                        else f"{self._failures} consecutive failures",
                        self._cooldown_s, self.last_failure or "unknown")
        elif state is BreakerState.HALF_OPEN:
            log.info("upstream %s: circuit breaker half-open, letting one trial through",
                     self._name)
        else:
            log.warning("upstream %s: circuit breaker closed, the upstream answers again",
                        self._name)

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

    def success(self) -> None:
        self._failures = 0
        self._trial_in_flight = False
        if self._clock() < self._rest_until:
            # The answer to a request sent before the upstream asked for its rest, which
            # still holds: shown closed, it would be taken for asked meanwhile.
            return
        self._set(BreakerState.CLOSED)

    def failure(self, reason: str = "") -> bool:
        """Record a failure; True when this one opened the breaker."""
        self.last_failure = reason
        self._trial_in_flight = False
        self._failures += 1
        if self._threshold and (
            self.state is BreakerState.HALF_OPEN or self._failures >= self._threshold
        ):
            self._opened_at = self._clock()
            opened = self.state is not BreakerState.OPEN
            self._set(BreakerState.OPEN)
            return opened
        return False
