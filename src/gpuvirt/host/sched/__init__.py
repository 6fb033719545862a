"""The world-switch scheduler: which VF has the device, for how long, and FULLACCESS.

- scheduler.py: the scheduler thread, its loop and the ops it runs for the host's loop;
- switch.py: a switch's commands (through Engine.switch_out/switch_in, where the
  preemptive and cooperative backends differ) and the stops posted, not yet confirmed;
- policy.py: what runs next and when a slice ends (round_robin, weighted, liquid);
- entry.py: one VF's record and counters, read from its engine's untrusted words;
- ops.py: the thread's inbox, ops other threads post and the eventfd that wakes it;
- watch.py: the epoll set that wakes the thread;
- fullaccess.py: one VF alone on the device (the init lock on the loop, the grant on
  the thread).
"""

from gpuvirt.host.sched.fullaccess import FullAccess
from gpuvirt.host.sched.policy import Policy
from gpuvirt.host.sched.scheduler import Scheduler

__all__ = ["FullAccess", "Policy", "Scheduler"]
