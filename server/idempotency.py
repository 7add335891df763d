"""Idempotency keys: which (actor_id, seq) were applied, and their responses.

Memory is bounded three ways, and past each bound the server refuses rather than
apply a key twice:

* per actor, the highest seq applied and a bitmap of the ``window`` sequence
  numbers below it (an anti-replay window, as in IPsec); a seq older than the
  window cannot be told apart from an applied one and is refused (ALREADY_EXISTS);
* responses sit in an LRU cache of ``capacity`` entries; each actor's latest
  response is kept outside it, so a client resending its last request after a
  dropped connection always gets its result back; a resent key whose response
  is gone is refused (ALREADY_EXISTS);
* at most ``max_actors`` actors are tracked.  A new actor past that takes the
  place of the least recently seen one only if that one has sent nothing for
  ``idle_s`` seconds; otherwise the new actor's request is refused
  (RESOURCE_EXHAUSTED) and nothing is applied.  This is the one exception to
  exactly-once: a retry from an actor forgotten so (idle ``idle_s``, then more
  than ``max_actors`` others seen) would be applied again.

Not thread-safe: the service calls it under the lock that applies steps.

:meth:`KeyGuard.to_bytes` / :meth:`KeyGuard.from_bytes` carry the records
into a checkpoint and back, so a key applied before a checkpoint stays applied
after a restart from it.  Format 2: ``DQR2``, the length of a JSON index (8 bytes,
little-endian), the index (actors, keys, and each response's message type and
length), then the responses' protobuf bytes back to back.
"""

from __future__ import annotations

import json
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from google.protobuf.message import DecodeError

from duelq.server.core.errors import InvalidArgument, LearnerError, ResourceExhausted

MAX_ACTOR_ID_BYTES = 128
_MAGIC = b"DQR2"
_LENGTH = struct.Struct("<Q")


class AlreadyApplied(LearnerError):
    """The key was applied before and its response is no longer kept."""


@dataclass
class _Actor:
    high: int = 0        # highest seq applied
    seen: int = 0        # bit i set ⇔ seq high − i applied, i < window
    latest: Any = None   # response of seq ``high``
    last: float = 0.0    # when it last sent a key (time.time(): it outlives restarts)


def _of_kind(response: Any, kind: type) -> bool:
    """Whether a recorded response is a ``kind``: an instance, or another object that says
    it encodes that message (its ``DESCRIPTOR``, as service.EncodedTrainResponse)."""
    return isinstance(response, kind) or (
        getattr(response, "DESCRIPTOR", None) is getattr(kind, "DESCRIPTOR", False))


def _name(response: Any) -> str:
    """The name of a recorded response's message."""
    descriptor = getattr(response, "DESCRIPTOR", None)
    return descriptor.name if descriptor is not None else type(response).__name__


class KeyGuard:
    """Applied keys and recorded responses, in bounded memory."""

    def __init__(self, *, capacity: int = 1024, window: int = 1024, max_actors: int = 4096,
                 idle_s: float = 3600.0, clock: Callable[[], float] = time.time):
        if capacity < 0 or window < 1 or max_actors < 1 or idle_s < 0:
            raise InvalidArgument("recorded_responses", "capacity and idle_s must be ≥ 0, window "
                                  "and max_actors ≥ 1")
        self.capacity, self.window, self.max_actors = capacity, window, max_actors
        self.idle_s, self._clock = idle_s, clock
        self._actors: OrderedDict[str, _Actor] = OrderedDict()
        self._responses: OrderedDict[tuple[str, int], Any] = OrderedDict()

    @staticmethod
    def check_key(actor_id: str, seq: int) -> None:
        """Refuse malformed keys (an empty actor_id means no key)."""
        if len(actor_id.encode()) > MAX_ACTOR_ID_BYTES:
            raise InvalidArgument("key.actor_id", f"is longer than {MAX_ACTOR_ID_BYTES} bytes")
        if actor_id and seq < 1:
            raise InvalidArgument("key.seq", "must be ≥ 1 when key.actor_id is set")

    def lookup(self, actor_id: str, seq: int, kind: type) -> Any | None:
        """The recorded response of an applied key, or None when the key is new.

        Raises AlreadyApplied when the key was applied (or is too old to tell)
        but its response is gone, InvalidArgument when the key was used by a
        request of another kind, ResourceExhausted when the key's actor is new
        and there is no room to track it (:meth:`record` would have to forget
        an actor that is not idle).
        """
        actor = self._actors.get(actor_id)
        if actor is None:
            self._make_room()
            return None
        self._actors.move_to_end(actor_id)
        actor.last = self._clock()
        if seq > actor.high:
            return None
        age = actor.high - seq
        if age >= self.window:
            raise AlreadyApplied(f"key {actor_id}/{seq} is older than the last {self.window} "
                                 f"sequence numbers of its actor (highest {actor.high}); "
                                 f"refusing to risk applying it twice")
        if not actor.seen >> age & 1:
            return None
        response = actor.latest if age == 0 else self._responses.get((actor_id, seq))
        if response is None:
            raise AlreadyApplied(f"key {actor_id}/{seq} was applied, but its recorded "
                                 f"response is no longer kept")
        if not _of_kind(response, kind):
            raise InvalidArgument("key.seq", f"{seq} of actor {actor_id!r} was already used "
                                  f"by a {_name(response)}")
        if age != 0:
            self._responses.move_to_end((actor_id, seq))
        return response

    def _make_room(self) -> None:
        """Make room for one more actor: forget the least recently seen if ``max_actors``
        are tracked and it has been idle ``idle_s``; ResourceExhausted if it has not."""
        while len(self._actors) >= self.max_actors:
            oldest_id, oldest = next(iter(self._actors.items()))
            idle = self._clock() - oldest.last
            if idle < self.idle_s:
                raise ResourceExhausted(
                    f"{len(self._actors)} actors' keys are tracked (max_actors "
                    f"{self.max_actors}) and the least recently seen sent one {idle:.0f} s "
                    f"ago, under actor_idle_s {self.idle_s:g}: a new actor_id is refused "
                    f"rather than forget keys that may still be retried; reuse an actor_id "
                    f"or retry later")
            self._forget(oldest_id)

    def record(self, actor_id: str, seq: int, response: Any) -> None:
        """Mark a key applied and keep its response (after a :meth:`lookup` of it)."""
        actor = self._actors.get(actor_id)
        if actor is None:
            self._make_room()
            actor = self._actors[actor_id] = _Actor()
        self._actors.move_to_end(actor_id)
        actor.last = self._clock()
        if seq > actor.high:
            if actor.latest is not None:
                self._keep((actor_id, actor.high), actor.latest)
            shift = seq - actor.high
            actor.seen = (actor.seen << shift | 1) & ((1 << self.window) - 1) \
                if shift < self.window else 1
            actor.high, actor.latest = seq, response
        else:
            actor.seen |= 1 << (actor.high - seq)
            self._keep((actor_id, seq), response)

    def copy(self) -> "KeyGuard":
        """A copy that shares the recorded responses (never mutated once recorded)."""
        other = KeyGuard(capacity=self.capacity, window=self.window,
                            max_actors=self.max_actors, idle_s=self.idle_s, clock=self._clock)
        other._actors = OrderedDict((a, replace(rec)) for a, rec in self._actors.items())
        other._responses = OrderedDict(self._responses)
        return other

    def to_bytes(self) -> bytes:
        """Every record, LRU order kept (format 2); responses must be protobuf messages
        (or encoded ones: SerializeToString and DESCRIPTOR)."""
        blobs: list[bytes] = []
        kinds: list[list] = []

        def ref(response: Any) -> int | None:  # the response's blob number
            if response is None:
                return None
            blobs.append(response.SerializeToString())
            kinds.append([_name(response), len(blobs[-1])])
            return len(blobs) - 1

        index = json.dumps({
            "format": 2, "window": self.window,
            "actors": [[a, rec.high, format(rec.seen, "x"), ref(rec.latest), rec.last]
                       for a, rec in self._actors.items()],
            "responses": [[a, seq, ref(r)] for (a, seq), r in self._responses.items()],
            "blobs": kinds,
        }, separators=(",", ":")).encode()
        return b"".join([_MAGIC, _LENGTH.pack(len(index)), index, *blobs])

    @classmethod
    def from_bytes(cls, data: bytes, kinds: Mapping[str, type], *, capacity: int = 1024,
                   max_actors: int = 4096, idle_s: float = 3600.0,
                   clock: Callable[[], float] = time.time) -> "KeyGuard":
        """Records written by :meth:`to_bytes`; ``kinds`` maps message names to classes.

        The stored window is kept (a wider one would forget applied keys); the
        response cache is trimmed to ``capacity``; every actor is kept, even past
        ``max_actors`` (new ones are then refused until old ones are idle).  An
        actor stored without the time it was last seen (earlier versions) counts
        as seen now.  Raises ValueError when ``data`` is malformed.
        """
        try:
            doc, message = cls._parse(bytes(data), kinds)
            guard = cls(capacity=capacity, window=int(doc["window"]), max_actors=max_actors,
                        idle_s=idle_s, clock=clock)
            now = clock()
            for actor_id, high, seen, latest, *last in doc["actors"]:
                if not isinstance(actor_id, str) or not isinstance(high, int) or high < 0:
                    raise ValueError(f"bad actor record {actor_id!r}/{high!r}")
                guard._actors[actor_id] = _Actor(high, int(seen, 16) & ((1 << guard.window) - 1),
                                                 message(latest), float(last[0]) if last else now)
            for actor_id, seq, response in doc["responses"]:
                guard._keep((str(actor_id), int(seq)), message(response))
        except (KeyError, IndexError, TypeError, ValueError, DecodeError, struct.error) as exc:
            raise ValueError(f"malformed idempotency records: {exc!r}") from exc
        return guard

    @staticmethod
    def _parse(data: bytes, kinds: Mapping[str, type]) -> tuple[dict, Callable[[Any], Any]]:
        """(the record index, a function from a response reference to the message)."""
        if not data.startswith(_MAGIC):
            raise ValueError(f"no {_MAGIC!r} magic: not idempotency records")
        start = len(_MAGIC) + _LENGTH.size
        (length,) = _LENGTH.unpack_from(data, len(_MAGIC))
        doc = json.loads(data[start:start + length])
        if doc["format"] != 2:
            raise ValueError(f"format {doc['format']!r} after the format-2 magic")
        offsets, at = [], start + length
        for name, size in doc["blobs"]:
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"bad blob length {size!r}")
            offsets.append((kinds[name], at, at + size))
            at += size
        if at != len(data):
            raise ValueError(f"{len(data) - at} bytes after the last response")

        def stored(item: Any) -> Any:
            if item is None:
                return None
            kind, begin, end = offsets[item]
            return kind.FromString(data[begin:end])
        return doc, stored

    def _keep(self, key: tuple[str, int], response: Any) -> None:
        if self.capacity == 0:
            return
        self._responses[key] = response
        self._responses.move_to_end(key)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def _forget(self, actor_id: str) -> None:
        del self._actors[actor_id]
        for key in [k for k in self._responses if k[0] == actor_id]:
            del self._responses[key]
