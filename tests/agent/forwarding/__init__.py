"""The agent forwarding what ranks and the kernel say: events, logs, OOM kills."""
