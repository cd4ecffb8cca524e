"""Tests through the real local Supabase-compatible stack (tests/supabase_stack.py; its fixtures,
``stack`` and ``supabase_stack``, are registered by tests/conftest.py).

A package (``__init__.py``), so this conftest does not shadow tests/conftest.py for the test modules
that do ``from conftest import ...``; not named ``supabase``, which would shadow the client library.
"""
