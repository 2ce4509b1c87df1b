"""Pure scheduling: filters -> scorers -> picker over frozen endpoint views.

Never imports starlette, httpx, kubernetes or kopf (import-linter contract).
"""
