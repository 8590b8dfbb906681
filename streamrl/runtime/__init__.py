"""The running system: the run's services (Ray, router, engines, learner, rollout workers,
broadcaster; runtime/services.py) and the per-step operations `streamrl/runtime/loop.py` is made of
(runtime/steps.py); `runtime/run.py` starts a run or resumes one."""


class RunFailed(RuntimeError):
    """The run cannot go on (the message says why and what to check); the CLI exits 2."""


class RunLost(RunFailed):
    """A process the run needs died mid-run (its node lost, say); `--resume` continues the run. Exit 1."""
