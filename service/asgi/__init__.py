"""The ASGI pieces around the routers: the agents' fast lane, request limits, metrics, the access
log filter, error shapes and the background tasks; service/main.py puts them together."""
