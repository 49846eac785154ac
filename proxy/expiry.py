"""How long each remembered outcome is believed, in one place, read from the config.

Like symbolicator: a miss is asked again soon (some upstreams publish minutes after a first
miss, so a repeated one doubles its time, up to a ceiling), a malformed file after a day, and
failures of a source or of symgate itself are never persisted at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from proxy.config import Config
from symbolize.outcome import Outcome

# How much further ahead than its time a row may expire and still be believed: another
# replica's clock a little ahead of this one's (NTP keeps them within milliseconds).
CLOCK_SKEW_S = 10.0


@dataclass(frozen=True, slots=True)
class Expiry:
    not_found_initial_s: float
    not_found_max_s: float
    no_symbols_s: float
    malformed_s: float

    @classmethod
    def from_config(cls, config: Config) -> Expiry:
        return cls(
            not_found_initial_s=config.negative.not_found_initial_ttl_s,
            not_found_max_s=config.negative.not_found_ttl_s,
            no_symbols_s=config.symbolize.no_symbols_retry_s,
            malformed_s=config.symbolize.malformed_retry_s,
        )

    def seconds(self, outcome: Outcome, repeats: int = 1) -> float | None:
        """How long to believe `outcome`, seen `repeats` times in a row; None: do not keep it."""
        if outcome is Outcome.NOT_FOUND:
            doubled: float = self.not_found_initial_s * 2.0 ** (max(repeats, 1) - 1)
            return min(doubled, self.not_found_max_s)
        if outcome is Outcome.NO_SYMBOLS:
            return self.no_symbols_s
        if outcome is Outcome.MALFORMED:
            return self.malformed_s
        return None

    def believed(self, outcome: str, expires_at: datetime, now: datetime, repeats: int = 1
                 ) -> bool:
        """Whether a row of `outcome` that expires at `expires_at` is still believed at `now`:
        not expired, and not expiring further ahead than the outcome is kept for now. Rows
        hold wall-clock times: a clock stepped back since one was written (an NTP step, a
        restored snapshot), or a time lowered in the config since, must not stretch it."""
        left = (expires_at - now).total_seconds()
        try:
            longest = self.seconds(Outcome(outcome), repeats)
        except ValueError:  # an outcome this version does not know
            return False
        return left > 0 and longest is not None and left <= longest + CLOCK_SKEW_S
