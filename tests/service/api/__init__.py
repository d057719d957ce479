"""The service's HTTP surface: routes, auth, bad input, the commands, the pages."""
