"""The running system: the run's services (Ray, router, engines, learner, rollout workers,
broadcaster; runtime/services.py) and the per-step operations `streamrl/loop.py` is made of
(runtime/steps.py); `runtime/run.py` starts a run or resumes one."""


class RunFailed(RuntimeError):
    """The run cannot go on (the message says why and what to check); the CLI exits 2."""
