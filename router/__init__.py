"""The HTTP ingress in front of the pools: bearer auth (`auth`), bounded body reading (`body`),
parsing and pricing a request (`pricing`), quotas (`quota`, pure; `leases`, the ledger and each
replica's leases), pool load (`load`) and the pure routing policy (`policy`), the pool-stream
protocol and each request's settlement (`stream`), the admin endpoints (`admin`), the route
(`app.Router`) and its paths (`ingress`)."""
