"""Engines in processes of their own. `LLM(model, data_parallel_size=N, tensor_parallel_size=T)` runs N
full engines (replicas), each in its own process on its own T devices, behind one DataParallelEngine that
speaks LLMEngine's protocol; the server (nanovllm.serve) runs its engines the same way.

    engine.py          DataParallelEngine: the engine protocol over N replicas (requests go to the one
                       with the fewest tokens outstanding)
    receiver.py        the caller's record of the replicas' requests, kept by a thread that reads their pipes
    engine_process.py  one engine process seen from its parent: spawn, send, close and clean up
    engine_core.py     the engine process itself: its loop over an LLMEngine, and its messages
    replica.py         where replica i runs (its GPUs or cores), what it reports, what is left after it

Across machines nanovllm schedules nothing itself: see nanovllm.integrations.ray."""
