"""The SGLang side: everything that talks to an inference engine over SGLang's HTTP API.

`client` (one client for every engine call), `api` (the request/response shapes), `router`
(the real sglang-router, started and fed workers), `launcher` and `engine_actor` (engines placed
by Ray, SGLang on GPU or the embedded engine on CPU), `engine_process` (the command line either
runs), `weight_sync` (the learner-to-engines weight group and its buckets), and the embedded CPU
engine that speaks the same protocol (`engine_server` over `engine_core`)."""
