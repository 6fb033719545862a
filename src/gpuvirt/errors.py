"""Every error a gpuvirt user can meet. All derive from GpuvirtError.

Each message says what happened and what to do about it; callers catch the
specific class, people read the text.
"""

from __future__ import annotations


class GpuvirtError(Exception):
    """Base of every gpuvirt error."""


class ConfigError(GpuvirtError):
    """A configuration value was refused: the message names key, value and reason."""


class HostUnreachableError(GpuvirtError):
    """The host daemon's socket could not be reached."""


class AuthRefusedError(GpuvirtError):
    """The host refused ATTACH: wrong token, VF index, uid, or the VF is taken."""


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
    """The device backend could not do what was asked (engine start, backend missing)."""


class StateError(GpuvirtError):
    """An illegal state transition or world-switch step: a bug, never user input."""
