"""Development tooling of the monitor side, apart from runtime code: the demo of `fleet up --demo`."""
