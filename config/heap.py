"""The garbage collector in a web process that holds thousands of sockets.

CPython's full collection walks every tracked object, holding the GIL and so daphne's event loop: with 1,500
idle volunteers (~300,000 objects made since start-up) each one paused the loop 150-400 ms, and a storm of
reconnects set one off every few hundred connects (each new connection's objects count towards the next one).
Pages' p99 was those pauses (issue 15, item 3). Freezing only what survived each full collection still left
one every heartbeat at 3,000 volunteers (the objects made since the last freeze, 75 ms each).

So every second (daphne's connection check) everything alive is frozen (gc.freeze, which is O(1)): the
collector then walks only what the last second made. A frozen object that dies is still freed by its
reference count; only garbage in a reference cycle among frozen objects waits, and two things bound that: a
finished connection's cycles are broken when daphne lets it go (config/web_server.unlink), and once the
process's peak memory has doubled since the last full walk, the valve unfreezes it and collects everything
once. As a copying collector's doubling, those walks cost O(1) per object made. The valve reads the peak RSS
(getrusage, O(1)), not gc.get_freeze_count(): that walks the frozen list, and at 3,000 volunteers (750,000
frozen objects) its two calls a second took 26% of daphne's CPU (py-spy --native).

The collector's own full collections are off (its third threshold): the valve is the only full walk. They
walked what had reached the oldest generation since the last tick, and the presence heartbeat
(workers/presence.py) takes that past a quarter of the last walk in one go: objects alive only while it runs,
which the walk keeps. At 3,000 idle volunteers each walk took 20-90 ms over 86,000-240,000 objects and found
at most 142 of garbage; at 19,000, 359 walks paused the loop 110 s in all (3.3 s at the longest), 3-4 of
them every heartbeat (perf: the time is those list walks, a cache miss an object). What they would free is
garbage in a cycle that lived through two younger collections: the valve frees it, as it does the frozen.
The tick still freezes, so that a gc.collect() from any library walks only the last second's objects."""

from __future__ import annotations

import gc
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)
LOG_PAUSE_MS = 20.0
NEVER = 2**31 - 1  # younger collections before a full one: never (the threshold is a C int)


def peak_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux (bytes on macOS: a ratio holds)


@dataclass
class Heap:
    size: Callable[[], int] = peak_rss_kb
    clean: int = 0  # size() right after the last full walk (or start-up)
    valve_opened: int = 0
    started_at: float = 0.0
    pauses: list[float] = field(default_factory=list)  # full collections' pauses (ms) since the last tick

    def start(self) -> None:
        """At start-up, with the application loaded: what it made lives as long as the process."""
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self.clean = self.size()
        gc.callbacks.append(self._collected)
        frozen = gc.get_freeze_count()  # walks the frozen list: once, here
        logger.info("heap: started; %d objects frozen; pauses from %.0f ms logged", frozen, LOG_PAUSE_MS)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        """Times full collections; the collector calls it on whichever thread allocated."""
        if info["generation"] != 2:
            return
        if phase == "start":
            self.started_at = time.perf_counter()
        else:
            self.pauses.append(1000 * (time.perf_counter() - self.started_at))

    def tick(self) -> None:
        """From the event loop, every second: freezing inside the collector's callback would change its
        lists under it."""
        self._log()
        gc.freeze()
        if self.size() > 2 * self.clean:
            self.valve_opened += 1
            gc.unfreeze()
            gc.collect()  # one full walk, freeing the frozen cycles that died
            gc.freeze()
            self.clean = self.size()
            self._log()

    def _log(self) -> None:
        """Each full collection's pause (at INFO from LOG_PAUSE_MS: what pages waited behind)."""
        pauses, self.pauses = self.pauses, []
        for pause in pauses:
            level = logging.INFO if pause >= LOG_PAUSE_MS else logging.DEBUG
            logger.log(level, "heap: full collection paused %.1f ms", pause)
