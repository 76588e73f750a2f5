"""The HTTP edge: the server and its workers (`server`, `workers`), the fenced uvicorn internals
(`uvicorn_internals`), the client connection limits (`client_limits`) and the pure-ASGI middleware
(`middleware`). The top of the stack: it may import the app and every layer below; nothing imports it but the
command line and the app (which takes its middleware)."""
