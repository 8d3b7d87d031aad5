"""The pipe protocol between a task with several engines (launch/engines.py) and its members
(launch/member.py): one line per message, on raw descriptors of their own.

member -> task: `next` (a shard, please), `took N` (it holds shard N now), `done N` (shard N is
finished), last `exit {json}` (how it ended, an ExitRecord). task -> member: a shard number, or
`end`. A line cut short (a member killed while writing) or not understood is never an error of
the task: the reader gets None and the member is judged by how its process ended."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Optional, Union

from batchinfer import errors

END = "end"  # the task's answer when it has no shard left for this member


class Message(Enum):
    """What a member says."""

    NEXT = "next"
    TOOK = "took"
    DONE = "done"
    EXIT = "exit"


class Status(Enum):
    """How a member ended."""

    DONE = "done"  # every shard it took is finished
    STOPPED = "stopped"  # a stop signal: committed and stopped
    FAILED = "failed"  # its engine (or anything not the config's fault) failed
    ERROR = "error"  # a config, input or storage error: another attempt would fail the same way
    DIED = "died"  # it said nothing (killed, crashed, a garbled record): judged by the task


@dataclass
class ExitRecord:
    """A member's last word: its status and what the task needs to decide."""

    status: Status
    signal: Optional[int] = None  # STOPPED: the signal
    kind: Optional[str] = None  # ERROR: the error class (errors.py) to raise again
    error: Optional[str] = None
    shard: Optional[int] = None  # FAILED: the shard it failed on
    failures: Optional[int] = None  # that shard's failures in this submission (None: not counted)

    @classmethod
    def for_error(cls, e: errors.BatchinferError) -> ExitRecord:
        """ERROR: a config, input or storage error, to be raised again by the task (rebuilt_error)."""
        return cls(Status.ERROR, kind=type(e).__name__, error=str(e))

    def rebuilt_error(self, summary: str) -> errors.BatchinferError:
        """The member's own error class (errors.py, by its name in `kind`), with the task's summary."""
        cls = getattr(errors, str(self.kind), None)
        message = f"{self.error} ({summary})"
        if isinstance(cls, type) and issubclass(cls, errors.BatchinferError):
            try:
                return cls(message)
            except TypeError:
                pass
        return errors.BatchinferError(message)

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps({**asdict(self), "status": self.status.value})

    @classmethod
    def from_json(cls, text: str) -> Optional[ExitRecord]:
        """The record, or None when the text is not one (cut short, garbled)."""
        try:
            d = json.loads(text)
            rec = cls(**{**d, "status": Status(d["status"])})
        except (ValueError, TypeError, KeyError):
            return None
        ints = (rec.signal, rec.shard, rec.failures)
        if any(v is not None and not isinstance(v, int) for v in ints):
            return None
        return rec


Said = tuple[Message, Union[int, ExitRecord, None]]


def encode(message: Message, arg: Union[int, ExitRecord, None] = None) -> bytes:
    """A member's line: `next`, `took 3`, `done 3`, `exit {...}`."""
    if message is Message.EXIT:
        assert isinstance(arg, ExitRecord)
        return f"exit {arg.to_json()}\n".encode()
    return (message.value if arg is None else f"{message.value} {arg}").encode() + b"\n"


def decode(line: bytes) -> Optional[Said]:
    """A member's line as (message, shard or record), or None when it is not a whole message."""
    try:
        text = line.decode()
    except UnicodeDecodeError:
        return None
    if not text.endswith("\n"):
        return None  # cut short
    word, _, rest = text.strip().partition(" ")
    try:
        message = Message(word)
    except ValueError:
        return None
    if message is Message.NEXT:
        return (message, None) if not rest else None
    if message is Message.EXIT:
        record = ExitRecord.from_json(rest)
        return None if record is None else (message, record)
    return (message, int(rest)) if rest.isdigit() else None


def answer(shard: Optional[int]) -> bytes:
    """The task's answer to `next`: a shard number, or `end`."""
    return f"{END if shard is None else shard}\n".encode()


def parse_answer(line: str) -> Optional[int]:
    """The shard in the task's answer; None for `end`, a closed pipe or anything else."""
    line = line.strip()
    return int(line) if line.isdigit() else None


class LineReader:
    """Whole lines from a raw descriptor read as select() says it is ready; the rest is kept."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def read(self) -> list[bytes]:
        """The whole lines available now (one read); at end of file, a last partial line too."""
        try:
            chunk = os.read(self.fd, 65536)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EINTR):
                return []
            chunk = b""  # EIO and the like: the member is as good as gone
        if not chunk:
            self.eof = True
            rest, self.buffer = self.buffer, b""
            return [rest] if rest else []
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [ln + b"\n" for ln in lines]


def send(fd: int, data: bytes) -> bool:
    """Write data whole to a raw descriptor; False if the reader is gone (nothing is kept to raise later)."""
    try:
        while data:
            data = data[os.write(fd, data) :]
    except (BrokenPipeError, ConnectionResetError):
        return False
    except OSError as e:
        if e.errno == errno.EPIPE:
            return False
        raise
    return True
