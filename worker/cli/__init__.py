"""The worker-side commands of `fleet`, one module per command group, on a shared context; they parse, call and print (the app is composed in monitor.cli.app)."""
