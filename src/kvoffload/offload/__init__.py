"""The offloading backend: what to move (scheduler side) and moving it (worker side).

Public modules (the ``_``-prefixed ones are their implementation):

* ``keys`` - offload keys (block hash + group id) and chunk arithmetic, a reference block hasher.
* ``policy`` / ``manager`` - the host block manager with LRU and ARC eviction (vLLM 0.33 semantics).
* ``lookup`` / ``misses`` - the per-group chunk scans of a lookup, and why a wanted chunk was not loaded.
* ``scheduler`` - per-request lookup, load and store decisions, one ``StepPlan`` per engine step.
* ``pool_plan`` / ``host_pool`` - how many chunk rows fit the host budget, and the pool itself.
* ``copy`` / ``integrity`` / ``worker`` - asynchronous page copies, the per-sub-block key tags and checksums,
  StepPlan execution (torch; imported only when used).
"""
