"""This node as the service sees it: the operator's health check and the agent's own figures."""
