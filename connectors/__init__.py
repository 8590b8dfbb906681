"""Backends StreamRL drives: `sglang/` (engines, router, weight sync to engines) and `megatron/`
(the learner). `auth` (run-server keys) and `ports` (loopback-first listening sockets and the
TCP store) are the network edge both backends and the run servers share."""
