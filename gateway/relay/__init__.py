"""The relay to the engine: client.py (pooled client, the one aiohttp error mapping), exchange.py (one request's
exchange, EngineRelay), sse.py (the stream relay), monitor.py (readiness), activity.py (progress the relay
sees), model.py (ModelInfo)."""
