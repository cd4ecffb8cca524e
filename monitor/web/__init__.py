"""``fleet web``: the live operator console in a browser (Starlette, Jinja2 templates, uvicorn).

:mod:`.reads` reads the views on either back-end, :mod:`.actions` makes the operator's calls through
the store's methods (the CLI's SQL functions), :mod:`.auth` says who may look and act, :mod:`.app`
puts the pages together. ``templates/`` and ``static/`` are the pages and their small script; there
is no build step.
"""
