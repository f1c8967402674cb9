"""The supervisor's TCP face: the app, one routes module per API, auth, guard, limits, metrics, the access log, OpenAPI."""
