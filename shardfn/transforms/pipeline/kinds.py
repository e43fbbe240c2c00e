"""The pipeline's vocabularies: what an action, a message and a wait can be.

Each is a ``str``-valued enum whose members compare, hash, print and format as their
string (``ActionKind.F == "F"``, ``{("act", 0, 0): v}[(MessageKind.ACT, 0, 0)]``), so a
schedule written by hand with strings, a message key from a caller and a printed key
all read as before; the names of the members are what the code spells.

Example:
    >>> ActionKind.F == "F", MessageKind.ACT, f"{WaitKind.RECV} wait"
    (True, 'act', 'recv wait')
    >>> sorted(k.value for k in ActionKind)
    ['B', 'F', 'W']
"""

from __future__ import annotations

import enum

__all__ = ["LOSS_KEY", "ActionKind", "MessageKey", "MessageKind", "Status", "WaitKind"]


class _Word(str, enum.Enum):
    """A str-valued enum member that behaves as its string everywhere but ``is``."""

    __hash__ = str.__hash__
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return str.__repr__(self.value)


class ActionKind(_Word):
    """What one action of a schedule runs (:class:`~.schedules.Action`)."""

    F = "F"  # forward of a stage on a micro-batch
    B = "B"  # backward: full, or only the input gradient when the schedule splits backward
    W = "W"  # the weight gradient (split-backward schedules only)


class MessageKind(_Word):
    """What a pipeline message ``(kind, stage, microbatch)`` carries (:mod:`.messages`)."""

    ACT = "act"  # stage ``stage``'s output (the next stage's input)
    GRAD = "grad"  # the gradient of stage ``stage``'s input (the previous stage's output)
    LOSS = "loss"  # the step's loss, from the last stage's rank to every other
    OUT = "out"  # inference: the model's output of micro-batch ``microbatch``
    LEAF = "leaf"  # ``gather``: the leaf at index ``microbatch`` of the full tree


#: a message: ``(kind, stage, microbatch)`` (a plain-string kind compares equal)
MessageKey = tuple[MessageKind, int, int]
#: the step's loss, sent by the last stage's rank to every other pp rank
LOSS_KEY: MessageKey = (MessageKind.LOSS, 0, 0)


class WaitKind(_Word):
    """What a rank waited for, in a timeline (:mod:`.timeline`)."""

    RECV = "recv"  # blocked receiving an action's input or output gradient
    SEND = "send"  # blocked waiting for sends to finish


class Status(enum.IntEnum):
    """The status word of a message header (:mod:`._p2p`)."""

    OK = 0  # the value follows
    ERROR = 1  # the sender failed; its error's text follows
    NONE = 2  # no tensor (the gradient of an integer activation)
