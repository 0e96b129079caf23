"""Restart the processes of a local stack when they exit, like a process manager: each one is
started again after a delay that doubles with every exit in a row (0.5 s up to 30 s) and
starts over once it has run for a stable period; a crash loop is reported as one."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """When to restart a process that exited (systemd's `Restart=always` with a growing delay)."""

    initial_delay: float = 0.5
    max_delay: float = 30.0
    stable_period: float = 60.0  # a process that ran this long starts over at `initial_delay`
    crash_loop_after: int = 3  # exits in a row that make a crash loop

    def delay(self, exits: int) -> float:
        """The wait before the restart that follows the `exits`-th exit in a row."""
        return min(self.initial_delay * 2.0 ** (exits - 1), self.max_delay)


@dataclass
class _Child:
    started_at: float
    exits: int = 0  # in a row, each before the process ran `stable_period`
    restart_at: float | None = None  # set while the process is down


class Supervisor:
    """Watches `procs` (name -> process, replaced in place by `restart(name)`) from a thread
    and restarts what exits, until the name is retired; reports through `say`."""

    def __init__(
        self,
        procs: Mapping[str, subprocess.Popen[bytes]],
        restart: Callable[[str], None],
        say: Callable[[str], None],
        backoff: Backoff | None = None,
        poll_interval: float = 0.1,
    ) -> None:
        self._procs = procs
        self._restart = restart
        self._say = say
        self.backoff = backoff or Backoff()
        self._poll_interval = poll_interval
        self._children: dict[str, _Child] = {}
        self._retired: set[str] = set()
        self._lock = threading.Lock()  # held while checking or restarting
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skiff-supervisor", daemon=True)

    def start(self) -> None:
        now = time.monotonic()
        self._children = {name: _Child(now) for name in self._procs}
        self._thread.start()

    def retire(self, name: str) -> None:
        """Leave `name` down from now on (it is being stopped); waits out a restart under way."""
        with self._lock:
            self._retired.add(name)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._poll_interval):
            with self._lock:
                self.tend(time.monotonic())

    def tend(self, now: float) -> None:
        """Note the processes that exited and restart those whose delay is over."""
        for name, child in self._children.items():
            if name in self._retired:
                continue
            proc = self._procs[name]
            if child.restart_at is None and proc.poll() is not None:
                self._down(name, child, f"exited with code {proc.returncode}", now)
            elif child.restart_at is not None and now >= child.restart_at:
                self._start(name, child)

    def _down(self, name: str, child: _Child, why: str, now: float) -> None:
        if now - child.started_at >= self.backoff.stable_period:
            child.exits = 0
        child.exits += 1
        delay = self.backoff.delay(child.exits)
        child.restart_at = now + delay
        if child.exits >= self.backoff.crash_loop_after:
            self._say(
                f"{name} {why}: crash loop, {child.exits} exits in a row, each within "
                f"{self.backoff.stable_period:.0f} s of its start (see its log); "
                f"restarting in {delay:g} s"
            )
        else:
            self._say(f"{name} {why}; restarting in {delay:g} s")

    def _start(self, name: str, child: _Child) -> None:
        child.started_at = time.monotonic()
        try:
            self._restart(name)
        except Exception as exc:  # a supervisor outlives any failed start
            proc = self._procs[name]
            if proc.poll() is None:  # started but not up (e.g. no port): try again later
                proc.kill()
                proc.wait()
            self._down(name, child, f"failed to start ({exc})", time.monotonic())
            return
        child.restart_at = None
        self._say(f"{name} restarted (pid {self._procs[name].pid})")
