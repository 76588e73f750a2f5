"""HTTP routes; each module exports `router`, and `table` declares every served route once.

Only `gateway.app` imports this package.
"""

from gateway.routes.table import SERVED, RouteTable, ServedRoute

__all__ = ["SERVED", "RouteTable", "ServedRoute"]
