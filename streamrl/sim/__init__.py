"""The cluster simulator: a discrete-event model that runs the core's rules against modelled engines,
learner and weight push (cluster.py, core only), what feeds it from a finished run (fromrun.py) and
`streamrl plan`'s sweep and choice (plan.py)."""
