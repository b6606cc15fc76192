"""The trainer API over HTTP (``rollouts api``, aiohttp): every handler calls
``store.client.RolloutClient``.

- ``schemas``: pydantic request/response models (validation and the OpenAPI document)
- ``wire``: JSON vs msgpack, packed arrays
- ``handlers`` / ``app``: the endpoints, the route table, the error/auth/metrics middleware
- ``openapi``, ``auth``, ``metrics``, ``errors``, ``views``, ``cli``
"""
