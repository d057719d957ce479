"""What goes to the service: the attempts' event spools (stamped, batched, never lost) and the ranks' output."""
