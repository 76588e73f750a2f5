"""The relay to the engine: client.py (the engine client, its one error mapping), http1.py (its keep-alive HTTP/1.1
connections and their pool), exchange.py (one request's exchange, EngineRelay), sse.py (the stream relay),
disconnect.py (the client-disconnect watcher), monitor.py (readiness), activity.py (progress the relay sees),
readiness.py (the engine record every worker shares), served_model.py (ModelInfo)."""
