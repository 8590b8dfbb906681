"""The functional core: the rules and data of streaming RL as plain functions and small classes
(types, version spans, staleness and admission, claim selection, the ledger, partial-rollout
transitions, the RL algorithms). Nothing here imports Ray, HTTP, LanceDB or the clock
(tests/test_layout.py enforces it), so it is unit-tested directly and reused by the cluster
simulator."""
