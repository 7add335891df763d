"""The server's own training from its replay buffer, holding ``replay_ratio``.

One thread: woken by each new insert (and once a second), it runs the replay steps that
the ratio asks for (while sampled + B ≤ ratio × inserted) in runs of at most
:data:`RUN_STEPS` (:meth:`LearnerService.train_due`): each starts under the service's apply
lock and runs on without it, so inserts go on meanwhile, and batch-path steps and
checkpoints take their turns between runs.  With inserts arriving meanwhile, which rows a
run draws from depends on timing; TrainReplay, called in a fixed order, is the
reproducible way to train from the buffer.
"""

from __future__ import annotations

import logging
import threading

from duelq.server.service import LearnerService, NotServing

log = logging.getLogger(__name__)

RUN_STEPS = 64      # steps per run (≈ 2 ms of device time at B = 256)
IDLE_WAIT_S = 1.0   # the longest the loop sleeps without an insert


class ReplayLoop:
    """Holds the replay ratio of ``service``'s learner until :meth:`stop`."""

    def __init__(self, service: LearnerService):
        self._service = service
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duelq-replay", daemon=True)
        self.steps = 0
        """Steps the loop has applied."""

    def start(self) -> None:
        self._thread.start()

    def notify(self) -> None:
        """Rows were inserted: look for due steps now."""
        self._wake.set()

    def stop(self) -> None:
        """Finish the current run and end the thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            while not self._stopping.is_set():
                try:
                    run = self._service.train_due(RUN_STEPS)
                except NotServing:   # draining: the server is stopping
                    return
                except Exception:  # noqa: BLE001 — keep the server up; the next insert retries
                    log.exception("training from the replay buffer failed")
                    break
                if run is None:
                    break
                self.steps += run.steps
                if run.refused:   # wait for new rows rather than draw again at once
                    log.warning("a replay step was refused (the state is unchanged); "
                                "trying again at the next insert, or in a second")
                    break
