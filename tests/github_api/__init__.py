"""A local stand-in for the part of GitHub's REST API lanefleet's GitHub source uses, and the checks
of its traffic against GitHub's own OpenAPI description (openapi.py, stand_in.py, fixture.py).

A package, imported from the tests as ``github_api`` (tests/ is on sys.path)."""
