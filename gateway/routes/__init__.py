"""HTTP routes: `table` declares every served route once; `health`, `metrics` and `openai` export a FastAPI
`router` for the rows without a handler; `openai` and `stored` hold the handlers the dispatcher calls directly;
`context` is what every handler takes from its request (services, record, the caller's key).

Only `gateway.app` imports this package.
"""

from gateway.routes.table import SERVED, RouteTable, ServedRoute

__all__ = ["SERVED", "RouteTable", "ServedRoute"]
