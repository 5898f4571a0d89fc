"""A drafter's side of one registration, without I/O: handshake replies, credits, ACKs, reconnects.

The worker's control loop owns the socket, the receiver thread, the clock and
the training; it hands every decoded message from the target here with the
current time and sends what comes back. This class decides: what a handshake
reply means (registered, refused for good, or retry), how many batches to ask
for (never more than ``drafter.credits`` in flight or granted, never past
``max_steps``), when a heartbeat is due, when the target counts as gone (silent
past its heartbeat timeout, a stalled capture, BYE, or an ERROR saying it no
longer knows us), and when the registration is finished (DONE and nothing
left in flight). A test drives it through every interleaving in-process.
"""

from __future__ import annotations

import logging

from common import protocol as P

logger = logging.getLogger(__name__)


class FatalError(RuntimeError):
    """The target refused this drafter for a reason retrying cannot fix (config/version mismatch)."""


class TargetUnavailable(RuntimeError):
    """The target is gone or not answering; retry with backoff."""


# ERROR codes of a HELLO that no retry can fix.
# A stale generation: the drafter was restarted since this process started (it is a leftover).
_FATAL_CODES = (P.E_CONFIG, P.E_TRANSPORT, P.E_VERSION, P.E_STALE)


def handshake_reply(msg: P.Message | None) -> P.Welcome | None:
    """The WELCOME, or None to keep waiting; raises FatalError / TargetUnavailable for an ERROR."""
    if isinstance(msg, P.Welcome):
        return msg
    if isinstance(msg, P.Error):
        if msg.code in _FATAL_CODES:
            raise FatalError(f"target refused this drafter: {msg.message}")
        raise TargetUnavailable(f"target answered ERROR {msg.code}: {msg.message}")
    return None


class Connection:
    """Steady state of one registration: credits, heartbeats, the target's liveness, DONE."""

    def __init__(self, *, credits: int, steps_per_batch: int, max_steps: int, heartbeat_interval_s: float,
                 heartbeat_timeout_s: float, label: str, now: float) -> None:
        self.credits = credits
        self.steps_per_batch = steps_per_batch
        self.max_steps = max_steps
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.label = label  # which target, for the log
        self.inflight = 0  # BATCH announced, not yet trained
        self.granted = 0  # credits the target holds and has not used
        self.done = False
        self._last_heard = now
        self._next_heartbeat = now
        self._handlers = {
            P.Heartbeat: self._on_heartbeat,
            P.Batch: self._on_batch,
            P.Done: self._on_done,
            P.Bye: self._on_bye,
            P.Error: self._on_error,
        }

    def start(self) -> list[P.Message]:
        self.granted = self.credits
        return [P.Request(credits=self.credits)]

    def outcome(self, step: int) -> str | None:
        """Why this registration's training ends now, or None to go on."""
        if self.max_steps and step >= self.max_steps:
            return "max_steps"
        if self.done and self.inflight == 0:
            return "done"
        return None

    def heartbeat(self, now: float, step: int) -> list[P.Message]:
        """A HEARTBEAT when one is due."""
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_interval_s
            return [P.Heartbeat(step=step)]
        return []

    def check_alive(self, now: float) -> None:
        """Raise TargetUnavailable once the target has been silent past its heartbeat timeout.

        Call it after reading the queued messages: after a long step they are waiting, not lost.
        """
        silent = now - self._last_heard
        if silent > self.heartbeat_timeout_s:
            raise TargetUnavailable(f"target silent for {silent:.1f}s (heartbeat timeout {self.heartbeat_timeout_s:.0f}s)")

    def on_message(self, msg: P.Message | None, now: float) -> P.Batch | None:
        """A message from the target (None: one that failed to decode); returns a BATCH to receive."""
        self._last_heard = now  # anything at all, even a bad frame, shows the target is there
        if msg is None:
            return None
        handler = self._handlers.get(type(msg))
        if handler is None:
            logger.warning("ignoring %s from the target: not something a target sends in this state", msg.TYPE)
            return None
        return handler(msg)

    def on_trained(self, batch_id: int, step: int, checkpoint_step: int) -> list[P.Message]:
        """A batch is in the weights: ACK it, and ask for one more unless that would pass max_steps."""
        self.inflight -= 1
        out: list[P.Message] = [P.Ack(batch_ids=[batch_id], step=step, checkpoint_step=checkpoint_step)]
        asked = self.inflight + self.granted
        past_budget = self.max_steps and step + asked * self.steps_per_batch >= self.max_steps
        if not past_budget and asked < self.credits:
            out.append(P.Request(credits=1))
            self.granted += 1
        return out

    # ---------------------------------------------------------------- handlers
    def _on_heartbeat(self, msg: P.Heartbeat) -> None:
        if msg.capture_stalled_s > 0:
            raise TargetUnavailable(f"the target's capture has made no progress for {msg.capture_stalled_s:.0f}s")

    def _on_batch(self, msg: P.Batch) -> P.Batch:
        self.inflight += 1
        self.granted -= 1
        return msg

    def _on_done(self, msg: P.Done) -> None:
        self.done = True
        logger.info("[done] %s has served every batch it owns", self.label)

    def _on_bye(self, msg: P.Bye) -> None:
        raise TargetUnavailable(f"target said BYE ({msg.reason})")

    def _on_error(self, msg: P.Error) -> None:
        if msg.code == P.E_STATE:
            # The target dropped this registration (it heard nothing for a heartbeat timeout,
            # e.g. while this side built its model): register again. Its ERROR replies count
            # as "heard", so waiting would never end.
            raise TargetUnavailable(f"target no longer knows this registration ({msg.message})")
        logger.warning("target reported ERROR %s: %s", msg.code, msg.message)
