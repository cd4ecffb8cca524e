"""Tests through the real local Supabase-compatible stack (tests/supabase_stack.py).

A package (``__init__.py``), so this conftest does not shadow tests/conftest.py for the test modules
that do ``from conftest import ...``; not named ``supabase``, which would shadow the client library.
"""

from supabase_stack import stack, supabase_stack  # noqa: F401  (fixtures)
