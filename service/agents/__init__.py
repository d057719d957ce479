"""The nodes' side of the service: who an agent is, its heartbeats, the commands it is handed."""
