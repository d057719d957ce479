"""Jobs' lives in the service: scheduling, restarts, diagnosis, peer loss, warm spares."""
