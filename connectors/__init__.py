"""Everything that talks to an outside engine or learner backend."""
