"""What a pool raises. (LancePool is the one pool; its methods are the contract.)"""

from __future__ import annotations


class PoolError(Exception):
    """The pool cannot be opened or used; the message says what to check."""


class NoPool(PoolError):
    """Opened without create: no pool at that URI (yet), as opposed to one that is there but unusable."""
