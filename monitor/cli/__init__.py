"""The `fleet` command: the app that composes every command, and the monitor-side command modules."""
