"""Every error a gpuvirt user can meet. All derive from GpuvirtError.

Each message says what happened and what to do about it; callers catch the
specific class, people read the text. One class per meaning, as urllib3's
exceptions: a value refused (ConfigError), a state that forbids the request now
(StateConflictError), the device backend failing (DeviceError), a host bug
(StateError). The admin API's status code follows from the class
(host/admin.py: 400, 409, 502, 500).
"""

from __future__ import annotations


class GpuvirtError(Exception):
    """Base of every gpuvirt error."""


class ConfigError(GpuvirtError):
    """A value was refused (configuration, `vf set`): the message names key, value and
    reason. Asking again with the same value fails again."""


class HostUnreachableError(GpuvirtError):
    """The host daemon's socket could not be reached."""


class AuthRefusedError(GpuvirtError):
    """The host refused ATTACH: wrong token, VF index, uid, or the VF is taken."""


class HostBusyError(AuthRefusedError):
    """The host refused ATTACH for load (too many connections waiting to attach, of
    all peers or of this uid) for as long as attach() kept trying; the message names
    which."""


class OutOfMemoryError(GpuvirtError):
    """The VF's FB has no free block large enough for an allocation."""


class BufferLostError(GpuvirtError):
    """A buffer whose contents are gone: its VF was reset, or it was freed."""


StaleBufferError = BufferLostError


class VFResetError(GpuvirtError):
    """The VF was reset (FLR) while work was pending; the work is lost."""


class DetachedError(GpuvirtError):
    """The guest has detached from its VF (or lost the host); attach again."""


class KernelError(GpuvirtError):
    """A tenant kernel raised inside the engine; the message carries its traceback."""


class DeviceError(GpuvirtError):
    """The device backend could not do what was asked (engine start, a world-switch
    command, backend missing): the request was valid and the state allowed it."""


class StateConflictError(GpuvirtError):
    """The request conflicts with a VF's or the host's state now: a guest holds the VF,
    it is resetting or disabled, it left the schedule while the request waited, or
    another host serves the socket. The same request may succeed once the state
    changes; the message says what to do."""


class StateError(GpuvirtError):
    """An illegal state transition or world-switch step: a host bug, never user input."""
