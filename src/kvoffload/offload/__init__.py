"""The offloading backend: what to move (scheduler side) and moving it (worker side).

* ``keys`` - offload keys (block hash + group id) and chunk arithmetic, a reference block hasher.
* ``policy`` / ``manager`` - the host block manager with LRU and ARC eviction (vLLM 0.33 semantics).
* ``scheduler`` - per-request lookup, load and store decisions, one ``StepPlan`` per engine step.
* ``host_pool`` / ``copy`` / ``worker`` - the host pool, asynchronous page copies, StepPlan execution
  (torch; imported only when used).
"""
