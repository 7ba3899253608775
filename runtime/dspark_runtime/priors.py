"""What ended `sync`/`async` requests teach the next ones at the same sampling temperature.

- The drafter: a temperature whose last n requests looked and never found drafting worth it (their survivals
  always said no) makes a new request take its first look after `Probes.FIRST`·2^(n-1) tokens instead of at once,
  so where drafts do not pay (often T=1 at real size) looking costs a shrinking share; one request whose survivals
  say yes resets the count, so no temperature stays shut for good.
- Free drafts: a new request starts from the share of free drafts its temperature's requests accepted (halved
  with every request ended, so a record of rejections fades and free drafts get tried again), not from one in two.
"""

from __future__ import annotations

from dspark_runtime.ngram import FreeDraftAcceptance
from dspark_runtime.scheduler import Probes

LONGEST_WAIT = 3  # a first look waits at most FIRST·2^LONGEST_WAIT tokens (128): a longer request still looks


class Priors:
    def __init__(self) -> None:
        self.declined: dict[float, int] = {}  # by temperature: ended requests in a row whose looks said no
        self.free: dict[float, tuple[float, float]] = {}  # by temperature: (verified, accepted) free drafts, decayed

    def probes(self, temperature: float) -> Probes:
        declined = self.declined.get(temperature, 0)
        first = 0 if not declined else Probes.FIRST << min(declined - 1, LONGEST_WAIT)
        return Probes(due=first, interval=max(Probes.FIRST, first))

    def free_acceptance(self, temperature: float) -> FreeDraftAcceptance:
        verified, accepted = self.free.get(temperature, (0.0, 0.0))
        return FreeDraftAcceptance((accepted + 0.5) / (verified + 1))  # one draft in two, worth one draft

    def ended(self, temperature: float, probes: Probes, free: FreeDraftAcceptance) -> None:
        """A request at `temperature` ended: what its survivals said (if ever weighed), and its free drafts."""
        if probes.paying:
            self.declined[temperature] = 0
        elif probes.declined:
            self.declined[temperature] = self.declined.get(temperature, 0) + 1
        verified, accepted = self.free.get(temperature, (0.0, 0.0))
        self.free[temperature] = (verified / 2 + free.verified, accepted / 2 + free.accepted)
