"""The relay to the engine: client.py (pooled client, the one aiohttp error mapping), aiohttp_internals.py (what
relies on aiohttp's stream reader), exchange.py (one request's exchange, EngineRelay), sse.py (the stream relay),
disconnect.py (the client-disconnect watcher), monitor.py (readiness), activity.py (progress the relay sees),
engine_state.py (the engine record every worker shares), served_model.py (ModelInfo)."""
