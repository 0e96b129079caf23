"""The waiting queue of a scheduling core, in the order of its scheduling policy (vLLM's
`--scheduling-policy`): first come, first served, or by (priority, arrival time)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from services.scheduler.request import Request


class RequestQueue(ABC):
    """Requests waiting to be admitted; `peek` is the next one."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Queue a preempted request again, ahead of those its policy ranks after it."""

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in the order they would be admitted."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival time): lower values first, ties in the order queued. A
    preempted request keeps its key, so it goes back to its own place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()  # breaks ties, so requests are never compared

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._order), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """Drop a request that leaves without being admitted (an abort): O(n)."""
        i = next(i for i, entry in enumerate(self._heap) if entry[3] is request)
        self._heap[i] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a `SchedulerConfig.scheduling_policy`."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
