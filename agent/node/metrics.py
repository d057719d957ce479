"""The agent's own figures: sent in every heartbeat and served on /metrics.

One plain object holds them; a collector reads it at scrape time, so the heartbeat and Prometheus
can never disagree. The registry is passed in (tests use a fresh one).
"""

from dataclasses import asdict, dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


@dataclass
class AgentStats:
    processes: int = 0  # live ranks of all worker groups
    events_forwarded: int = 0  # accepted by the service (repeats it ignored included)
    events_repeated: int = 0  # of those, the ones it already had (resent after a restart)
    events_buffered: int = 0  # read from the spools, not yet accepted
    backlog_bytes: int = 0  # spool bytes past the persisted read positions
    dead_letters: int = 0
    spool_bytes: int = 0
    forward_failures: int = 0
    heartbeat_failures: int = 0
    last_heartbeat: float = 0.0  # unix time of the last heartbeat the service answered
    # The ranks' own spools on a full disk (ett/events.py): events waiting for space, and dropped.
    rank_events_unwritten: int = 0
    rank_events_dropped: int = 0

    def heartbeat_figures(self) -> dict[str, float]:
        return asdict(self)


class StatsCollector(Collector):
    def __init__(self, stats: AgentStats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("ett_agent_processes", "Live ranks of the worker groups on this node", s.processes)
        yield CounterMetricFamily("ett_agent_events_forwarded", "Events the service accepted", s.events_forwarded)
        yield CounterMetricFamily("ett_agent_events_repeated", "Events the service already had",
                                  s.events_repeated)
        yield GaugeMetricFamily("ett_agent_events_buffered", "Events read and not yet accepted", s.events_buffered)
        yield GaugeMetricFamily("ett_agent_backlog_bytes", "Spool bytes not yet forwarded", s.backlog_bytes)
        yield CounterMetricFamily("ett_agent_dead_letters", "Events the service refused, set aside", s.dead_letters)
        yield GaugeMetricFamily("ett_agent_spool_bytes", "Disk used by the event spools", s.spool_bytes)
        yield CounterMetricFamily("ett_agent_forward_failures", "Event batches that failed to post",
                                  s.forward_failures)
        yield CounterMetricFamily("ett_agent_heartbeat_failures", "Heartbeats that failed", s.heartbeat_failures)
        yield GaugeMetricFamily("ett_agent_rank_events_unwritten",
                                "Events the node's ranks hold in memory for want of disk space",
                                s.rank_events_unwritten)
        yield GaugeMetricFamily("ett_agent_rank_events_dropped",
                                "Events the node's running ranks dropped past their memory bound",
                                s.rank_events_dropped)
        yield GaugeMetricFamily("ett_agent_last_heartbeat_timestamp_seconds",
                                "Unix time of the last answered heartbeat", s.last_heartbeat)


def serve_metrics(stats: AgentStats, port: int, registry: CollectorRegistry | None = None) -> WSGIServer:
    """Serves /metrics from a background thread; the server, to shut down when done."""
    registry = registry or CollectorRegistry()
    registry.register(StatsCollector(stats))
    server, _thread = start_http_server(port, addr="0.0.0.0", registry=registry)
    return server

