"""The agent process: its command, environment and end (the executor contract), and the supervisor that kills it when its shift dies."""
