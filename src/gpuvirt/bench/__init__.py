"""Benchmark suites behind `gpuvirt bench NAME`.

Each suite measures gpuvirt against a baseline run side by side in the same
process run (these machines are noisy; only ratios travel) and returns a
Result. Suites live in their own modules and are listed in SUITES.
"""

SUITES: dict[str, str] = {
    "launch": "gpuvirt.bench.launch",
    "sched": "gpuvirt.bench.sched",
    "flr": "gpuvirt.bench.flr",
    "netgpu": "gpuvirt.bench.netgpu",
    "scale": "gpuvirt.bench.scale",
    "chaos": "gpuvirt.bench.chaos",
    "fuzz": "gpuvirt.bench.fuzz",
    "isolation": "gpuvirt.bench.isolation",
}
# Run only when named, not part of `bench all`: chaos and fuzz take long; isolation
# needs a GPU (it refuses on emu).
LONG = ("chaos", "fuzz", "isolation")
