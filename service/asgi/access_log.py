"""uvicorn's access log without the agents' routine calls."""

import logging

from service.asgi.hot_paths import match_hot


class QuietAgentCalls(logging.Filter):
    """Leaves out of uvicorn's access log the agents' answered heartbeats and event batches:
    2,048 agents make 500 such lines a second, which drown the rest and cost the event loop
    6% of its time under load. Their errors (status 400 and over) are still logged; the counts
    and latencies of all of them are in /metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int) and args[4] < 400:
            return match_hot(str(args[2]).partition("?")[0]) is None
        return True
