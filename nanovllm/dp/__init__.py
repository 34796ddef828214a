"""Data parallelism on one host: `LLM(model, data_parallel_size=N, tensor_parallel_size=T)` runs N
full engines (replicas), each in its own process on its own T devices, and splits each `generate`
call's requests between them.

    engine.py       DataParallelEngine: LLMEngine's API over the replicas (nanovllm.llm.DataParallelLLM)
    coordinator.py  the caller's side: starts the replicas, hands out requests, gathers results
    replica_set.py  its record of the replica processes, and their release
    replica.py      one replica process: placement on its devices, an LLMEngine, its loop
    balance.py      how requests are split (by tokens, not counts); where replica i runs

Across machines nanovllm schedules nothing itself: see nanovllm.integrations.ray."""
