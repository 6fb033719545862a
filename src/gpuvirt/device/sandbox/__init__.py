"""Engine confinement: bubblewrap namespaces and mounts, a per-VF identity,
libseccomp, cgroups, Landlock and rlimits (DESIGN.md, "Tenant confinement")."""

from gpuvirt.device.sandbox.launch import Engined, Sandbox
from gpuvirt.device.sandbox.policy import Mode, Report, Settings

__all__ = ["Engined", "Mode", "Report", "Sandbox", "Settings"]
