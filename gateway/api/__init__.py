"""The API layer: `table` declares every served route once; `health`, `scrape` and `relayed` export a FastAPI
`router` for the rows without a handler; `relayed` and `stored` hold the handlers the dispatcher calls directly;
`context` is what every handler takes from its request (services, record, the caller's key); `validation`,
`schemas`, `bounds` and `reasoning` check and prepare a request body before it is admitted.

Only `gateway.app` imports this package.
"""

from gateway.api.table import SERVED, RouteTable, ServedRoute

__all__ = ["SERVED", "RouteTable", "ServedRoute"]
