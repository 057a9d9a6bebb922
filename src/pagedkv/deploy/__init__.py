"""Beyond one machine: pagedkv on Ray Serve.

`ray_serve` builds the application (the `pagedkv serve` HTTP app as the ingress, engine
replicas behind pagedkv's routing policy, autoscaling), `replica` is one engine replica,
`request_router` the routing policy as Ray Serve's request router, `ray_client` the
`EngineClient` the ingress drives, and `cli` is `pagedkv serve --ray`. Nothing here is
imported by the rest of pagedkv, so Ray is needed only with the `ray` extra.
"""
