"""Driver<->agent clock offset from ping exchanges (NTP-style, lowest RTT kept).

offset = agent_clock - driver_clock, estimated as a - (t0 + t1) / 2 for the
exchange with the smallest round trip t1 - t0; the error is at most RTT / 2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Awaitable, Callable


@dataclass(frozen=True)
class ClockOffset:
    offset_ns: int  # agent minus driver
    uncertainty_ns: int  # half the lowest round trip
    rtt_ns: int
    samples: int

    def to_agent(self, driver_ns: int) -> int:
        return driver_ns + self.offset_ns

    def to_driver(self, agent_ns: int) -> int:
        return agent_ns - self.offset_ns


def driver_now_ns() -> int:
    """The driver clock (monotonic)."""
    return time.monotonic_ns()


def estimate_offset(ping: Callable[[], int], samples: int = 20,
                    now: Callable[[], int] = driver_now_ns) -> ClockOffset:
    """``ping()`` returns the agent clock; keep the exchange with the lowest RTT."""
    exchanges = []
    for _ in range(max(1, samples)):
        t0 = now()
        a = ping()
        exchanges.append((t0, a, now()))
    return offset_from_exchanges(exchanges)


async def estimate_offset_async(ping: Callable[[], Awaitable[int]], samples: int = 20,
                                now: Callable[[], int] = driver_now_ns) -> ClockOffset:
    """:func:`estimate_offset` for the driver's event loop (``await ping()``)."""
    exchanges = []
    for _ in range(max(1, samples)):
        t0 = now()
        a = await ping()
        exchanges.append((t0, a, now()))
    return offset_from_exchanges(exchanges)


def offset_from_exchanges(exchanges: list[tuple[int, int, int]]) -> ClockOffset:
    """(driver before, agent, driver after) per exchange -> the offset of the one with the lowest RTT."""
    t0, a, t1 = min(exchanges, key=lambda e: e[2] - e[0])
    rtt = t1 - t0
    return ClockOffset(offset_ns=a - (t0 + rtt // 2), uncertainty_ns=(rtt + 1) // 2, rtt_ns=rtt,
                       samples=len(exchanges))
