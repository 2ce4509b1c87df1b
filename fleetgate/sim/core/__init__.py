"""The emulator's pure engine models: deterministic state machines, no I/O, no clock.

``api``           the contract with the HTTP layer (EngineModel, SimRequest, TokenEvent, ...)
``tokenizer``     the shared, stateless, exactly reversible tokenizer and chat template
``textgen``       output tokens as a pure function of (context, seed): resume-safe
``kv_vllm``       vLLM V1 paged block pool (null block, chained hashes, LRU free queue)
``kv_trtllm``     TensorRT-LLM block pool (32-token blocks, reuse counted in blocks)
``engine_base``   what both schedulers share: validation, the iteration, counters, errors
``sched_vllm``    vLLM V1 scheduler: fcfs/priority, chunked prefill, recompute preemption
``sched_trtllm``  TensorRT-LLM: GUARANTEED_NO_EVICT / MAX_UTILIZATION, fcfs/priority
``timing``        step-time model, calibrated named profiles, ``build_engine_model``
"""
