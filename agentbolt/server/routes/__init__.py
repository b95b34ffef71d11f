"""The server's routes, one module per resource; each builds an ``APIRouter`` that
:func:`agentbolt.server.app.create_app` includes."""
