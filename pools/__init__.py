"""One pool of vLLM replicas: its config models (`config`), the typed objects on its boundary
(`types`) and the control plane's contract (`control`), the admission gate (`gate`, pure, and
`admission`, its asyncio face), the KV budget (`kv_budget`), the engine seam (`engine`) with
its one adapter onto Ray LLM and vLLM (`llm`), the replica itself (`server.PoolServer`), CPU
priority and the engine reaper (`nice`, `reaper`), and the seeded tiny model (`tiny_model`)."""
