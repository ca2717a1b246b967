"""The garbage collector in a web process that holds thousands of sockets.

CPython's full collection walks every tracked object, holding the GIL and so daphne's event loop: with 1,500
idle volunteers (~300,000 objects made since start-up) each one paused the loop 150-400 ms, and a storm of
reconnects set one off every few hundred connects (each new connection's objects count towards the next one).
Pages' p99 was those pauses (issue 15, item 3).

So what survives a full collection is frozen (gc.freeze): the objects of the connections alive then, which
later collections skip. A frozen object that dies is still freed by its reference count; only garbage in a
reference cycle among frozen objects waits, and the bound on that is a valve: once the frozen heap has
doubled since the last collection that walked everything, it is unfrozen, and the next full collection walks
it all once and frees what died. Like a copying collector's doubling, the full walks cost O(1) per object
made, where before every 25% of growth or churn paid one."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)
SLACK = 100_000  # objects the frozen heap may grow by beyond doubling before the valve opens
LOG_PAUSE_MS = 20.0


@dataclass
class Heap:
    full_collections: int = 0  # seen by the callback, which may run on any thread
    frozen_after: int = 0  # full collections already answered by a freeze
    clean: int = 0  # the frozen heap right after the last collection that walked everything
    walks_all: bool = True  # nothing is frozen but start-up's: the next full collection sees it all
    valve_opened: int = 0
    started_at: float = 0.0
    pauses: list[float] = field(default_factory=list)  # full collections' pauses (ms) since the last tick

    def start(self) -> None:
        """At start-up, with the application loaded: what it made lives as long as the process."""
        gc.freeze()
        self.clean = gc.get_freeze_count()
        gc.callbacks.append(self._collected)
        logger.info("heap: started; %d objects frozen; pauses from %.0f ms logged", self.clean, LOG_PAUSE_MS)

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self.started_at = time.perf_counter()
        else:
            self.pauses.append(1000 * (time.perf_counter() - self.started_at))
            self.full_collections += 1

    def tick(self) -> None:
        """From the event loop (daphne's checker, every second): freezing inside the collector's callback
        would change its lists under it."""
        self._log()
        if self.full_collections > self.frozen_after:
            self._freeze_survivors()
        if not self.walks_all and gc.get_freeze_count() > 2 * self.clean + SLACK:
            gc.unfreeze()  # the next full collection walks it all, freeing the frozen cycles that died
            self.walks_all = True
            self.valve_opened += 1

    def _freeze_survivors(self) -> None:
        self.frozen_after = self.full_collections
        gc.freeze()
        if self.walks_all:
            self.clean, self.walks_all = gc.get_freeze_count(), False

    def _log(self) -> None:
        """Each full collection's pause (at INFO from LOG_PAUSE_MS: what pages waited behind)."""
        pauses, self.pauses = self.pauses, []
        frozen = gc.get_freeze_count()
        for pause in pauses:
            level = logging.INFO if pause >= LOG_PAUSE_MS else logging.DEBUG
            logger.log(level, "heap: full collection paused %.1f ms; %d objects frozen", pause, frozen)
