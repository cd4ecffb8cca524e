"""The worker-side commands of `fleet`, one module per command group, on a shared context; they parse, call and print (the app is composed in monitor.cli.app).

Every ``fleet`` command, ``fleet --help`` too, imports every command module, so a module imports at
its top only what typer needs to read the commands' signatures (typing, pathlib, typer, rich, the
shared options of worker.cli.context); a command imports what it does (the store, the runtime, the
config, pydantic models, structlog) inside its function (tests/test_startup_imports.py,
bench/startup.py). Typer evaluates a parameter's annotation when it builds the app: a type there
must be imported for real, never only under TYPE_CHECKING."""
